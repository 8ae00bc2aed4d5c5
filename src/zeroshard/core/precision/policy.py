"""Mixed-precision policy: which dtype each piece of training state lives in.

A policy object is handed to the stage; the stage never branches on "fp16 or bf16" itself.

- ``param_dtype``: the module's working parameters, used by forward and backward.
- ``grad_accum_dtype``: gradients accumulated across micro-steps (fp32 by default: accumulating
  in bf16 silently loses small contributions).
- ``reduce_dtype``: dtype on the wire for gradient collectives.
- master weights and optimizer state are always fp32.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from zeroshard.core.precision.loss_scaler import DynamicLossScaler, LossScaler


@dataclass(frozen=True)
class PrecisionPolicy:
    """Dtypes of the working parameters, gradient accumulators and gradient communication."""

    param_dtype: torch.dtype = torch.float32
    grad_accum_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    auto_cast: bool = True

    @property
    def master_dtype(self) -> torch.dtype:
        """Master weights and optimizer state are fp32."""
        return torch.float32

    def cast_inputs(self, obj: object) -> object:
        """Cast floating-point tensors inside ``obj`` (nested tuples, lists and mappings, of any type) to
        ``param_dtype``."""
        if not self.auto_cast or self.param_dtype == torch.float32:
            return obj
        return _cast(obj, self.param_dtype)


def _cast(obj: object, dtype: torch.dtype) -> object:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*[_cast(o, dtype) for o in obj])  # type: ignore[arg-type]
    if isinstance(obj, list):
        return [_cast(o, dtype) for o in obj]
    if isinstance(obj, tuple):
        return tuple(_cast(o, dtype) for o in obj)
    if type(obj) is dict:
        return {k: _cast(v, dtype) for k, v in obj.items()}
    if isinstance(obj, MutableMapping):  # keeps its type: HF's BatchEncoding/BatchFeature (UserDict), OrderedDict
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = _cast(v, dtype)
        return out
    if isinstance(obj, Mapping):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    return obj


def make_loss_scaler(fp16: Any) -> LossScaler:
    """Build the scaler DeepSpeed would from the ``fp16`` config section.

    Dynamic when fp16 is on with ``loss_scale == 0``, static for a positive ``loss_scale``, and a
    constant 1.0 when fp16 is off.
    """
    if not fp16.enabled:
        return LossScaler(1.0)
    if fp16.loss_scale and fp16.loss_scale > 0:
        return LossScaler(fp16.loss_scale)
    return DynamicLossScaler(
        init_scale=2.0**fp16.initial_scale_power,
        scale_window=fp16.loss_scale_window,
        min_scale=fp16.min_loss_scale,
        hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
    )
