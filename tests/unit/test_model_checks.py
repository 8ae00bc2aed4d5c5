"""Modules the ZeRO stages cannot train as plain PyTorch does are named at ``initialize`` (one process).

Before, a lazy module not yet run failed deep inside ``initialize`` with torch's "Can't access the
shape of an uninitialized parameter", naming nothing; ``nn.Embedding(sparse=True)`` crashed in a
gradient hook during backward ("reshape is not implemented for sparse tensors"); and an embedding
with ``max_norm`` trained silently away from plain PyTorch (its in-place renormalisation is lost at
ZeRO-3).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.errors import ConfigError, NotYetSupportedError


def _config(stage: int, bf16: bool = False) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0, "zero_optimization": {"stage": stage},
            "bf16": {"enabled": bf16}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


class _Net(nn.Module):
    def __init__(self, head: nn.Module, **embedding: object) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, **embedding)  # type: ignore[arg-type]
        self.head = head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids)).sum()


@pytest.mark.parametrize("stage", [0, 3])
def test_a_lazy_module_not_yet_run_is_named(stage: int, process_group: None) -> None:
    with pytest.raises(ConfigError, match=r"model parameter 'head.weight' is not materialized.*forward pass"):
        zeroshard.initialize(model=_Net(nn.LazyLinear(3)), config=_config(stage))


def test_a_lazy_module_after_one_forward_trains(process_group: None) -> None:
    model = _Net(nn.LazyLinear(3))
    model(torch.tensor([[1, 2]]))
    engine, *_ = zeroshard.initialize(model=model, config=_config(3))
    engine.backward(engine(torch.tensor([[1, 2]])))
    engine.step()
    engine.destroy()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_sparse_embedding_is_refused_by_name(stage: int, process_group: None) -> None:
    with pytest.raises(NotYetSupportedError, match=r"module 'emb' \(Embedding\) has sparse=True"):
        zeroshard.initialize(model=_Net(nn.Linear(4, 3), sparse=True), config=_config(stage))


@pytest.mark.parametrize("stage,bf16,warned", [(0, False, None), (1, False, None), (3, False, "ZeRO-3"),
                                               (0, True, "16-bit")])
def test_max_norm_embedding_warns_where_its_renormalisation_is_lost(stage: int, bf16: bool, warned: str | None,
                                                                    process_group: None,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """In a world of one, fp32 stages 0-2 keep the renormalisation (the weight the forward edits is
    the one the optimizer steps); ZeRO-3 edits the gathered copy, 16-bit training the 16-bit copy."""
    with caplog.at_level(logging.WARNING, logger="zeroshard"):
        engine, *_ = zeroshard.initialize(model=_Net(nn.Linear(4, 3), max_norm=1.0), config=_config(stage, bf16))
    engine.destroy()
    hits = [r.getMessage() for r in caplog.records if "max_norm" in r.getMessage()]
    assert len(hits) == (warned is not None), hits
    if warned:
        assert "'emb'" in hits[0] and warned in hits[0] and "never renormalised" in hits[0]
