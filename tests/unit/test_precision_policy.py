"""``PrecisionPolicy.cast_inputs``: what ``auto_cast`` does to the arguments of ``engine(...)``."""

from __future__ import annotations

from collections import OrderedDict, UserDict, namedtuple
from types import MappingProxyType

import torch

from zeroshard.core.precision.policy import PrecisionPolicy

BF16 = PrecisionPolicy(param_dtype=torch.bfloat16)


def test_casts_float_tensors_in_every_container_and_keeps_the_container_type() -> None:
    Pair = namedtuple("Pair", "x ids")
    x, ids = torch.randn(3), torch.arange(3)

    class Batch(UserDict):  # how HF's BatchEncoding / BatchFeature are built
        pass

    batch = Batch(pixel_values=x, input_ids=ids)
    got = BF16.cast_inputs((x, [x, ids], {"a": x}, OrderedDict(b=x), batch, MappingProxyType({"c": x}), Pair(x, ids)))
    assert isinstance(got, tuple)
    plain, nested, d, od, ud, proxy, pair = got
    assert plain.dtype == torch.bfloat16 and nested[0].dtype == torch.bfloat16 and nested[1] is ids
    assert d["a"].dtype == torch.bfloat16
    assert type(od) is OrderedDict and od["b"].dtype == torch.bfloat16
    assert type(ud) is Batch and ud["pixel_values"].dtype == torch.bfloat16 and ud["input_ids"] is ids
    assert batch["pixel_values"].dtype == torch.float32  # the caller's batch is not modified
    assert proxy["c"].dtype == torch.bfloat16
    assert type(pair) is Pair and pair.x.dtype == torch.bfloat16 and pair.ids is ids


def test_no_cast_when_off_or_in_fp32() -> None:
    x = torch.randn(2)
    assert PrecisionPolicy(param_dtype=torch.float16, auto_cast=False).cast_inputs(x) is x
    assert PrecisionPolicy().cast_inputs(x) is x
