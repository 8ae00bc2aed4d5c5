"""Ranks that disagree fail with an error naming the ranks and what differs, instead of pairing
collectives that were never meant to meet (or hanging): a different config, a skipped backward,
and under ZeRO-3 a different module on one rank (of the same size, so its all-gathers would
silently exchange the wrong parameters)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from harness import run_distributed
from torch import nn

import zeroshard
from zeroshard.errors import DistributedError


class Twins(nn.Module):
    """Two blocks of the same size: gathering one where a peer gathers the other would "work"."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.a, self.b, self.out = nn.Linear(7, 9), nn.Linear(9, 9), nn.Linear(9, 9), nn.Linear(9, 3)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.out(torch.tanh((self.b if use_b else self.a)(torch.tanh(self.inp(x)))))


def config(stage: int, lr: float = 1e-2) -> dict:
    # No ZeRO-3 prefetching: ranks whose module sequences differ also prefetch differently, and
    # all-gathers of different sizes abort inside gloo ("Is there a distributed collective mismatch
    # in your code?") before any check can run; here the two branches have the same size.
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  "stage3_prefetch_bucket_size": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": lr}}, "collective_timeout": 20}


def diverging_worker(rank: int, world: int, stage: int, kind: str) -> str:
    torch.manual_seed(0)
    model = Twins()
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config(stage))
    try:
        for step in range(3):
            for micro in range(2):
                x, y = torch.randn(2, 7), torch.randn(2, 3)
                off_path = rank == 1 and step == 1 and micro == 0
                loss = F.mse_loss(engine(x, use_b=off_path and kind == "module"), y)
                if not (off_path and kind == "backward"):
                    engine.backward(loss)
                engine.step()
    except DistributedError as e:
        return str(e)
    return "no error"


def config_worker(rank: int, world: int) -> str:
    model = nn.Linear(3, 3)
    try:
        zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config(2, 1e-2 * (1 + rank)))
    except DistributedError as e:
        return str(e)
    return "no error"


def test_different_configs() -> None:
    for message in run_distributed(config_worker, 2):
        assert "config entries differ" in message and "optimizer.params.lr" in message, message


def test_a_skipped_backward_at_every_stage() -> None:
    for stage in (0, 1):  # gradients are reduced at the window's last micro-step: checked there
        for message in run_distributed(diverging_worker, 2, stage, "backward"):
            assert "ranks disagree at micro-step 2 of 2 of optimizer step 1" in message, (stage, message)
            assert "backward passes in the window: rank 0: 1, rank 1: 0" in message, (stage, message)
    for stage in (2, 3):  # reduced every micro-step: checked before each backward
        for message in run_distributed(diverging_worker, 2, stage, "backward"):
            assert "micro-step of the window: rank 0: 0, rank 1: 1" in message, (stage, message)


def test_another_module_under_zero3() -> None:
    for message in run_distributed(diverging_worker, 2, 3, "module"):
        assert "ZeRO-3 gather sequence" in message, message
        assert "rank 0 gathered 'a.weight', rank 1 gathered 'b.weight'" in message, message
