"""Several ``engine.backward`` calls in one micro-step: multi-task losses each with its own backward,
two forwards (DPO's chosen and rejected, a contrastive pair) with a backward each.

Plain PyTorch accumulates ``.grad`` over the calls, so the step is the one ``backward(l1 + l2)``
would give. Stages 0 and 1 reduce their full-size accumulators at the boundary micro-step's
backward; a second backward there must add its gradients once, not reduce the first ones again
(before the fix: the first loss's gradient counted once per rank at stage 0, the accumulator's
other ranks' rows, the collective's workspace, added in at stage 1). 2 ranks, accumulation 2,
clipping 1.0, odd parameter sizes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import run_distributed
from models import gathered_weights, make_data, make_model, micro_batch, reference_by_micro_batch, relative_distance

import zeroshard

STEPS, GA, GLOBAL_BATCH, LR, CLIP, WORLD = 3, 2, 8, 1e-2, 1.0, 2
TOL = 1e-5


def _labels(y: torch.Tensor) -> torch.Tensor:
    """The second task's labels: another target for the same inputs."""
    return (y + 1) % 5


def worker(rank: int, world: int, zero: dict, nvme: str) -> dict[str, torch.Tensor]:
    if "offload_optimizer" in zero:
        zero = {**zero, "offload_optimizer": {**zero["offload_optimizer"], "nvme_path": nvme}}
    x, y = make_data(STEPS, GLOBAL_BATCH)
    micro_bs = GLOBAL_BATCH // (GA * world)
    cfg = {"train_micro_batch_size_per_gpu": micro_bs, "gradient_accumulation_steps": GA, "gradient_clipping": CLIP,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}, "zero_optimization": zero}
    engine, *_ = zeroshard.initialize(model=make_model(0), config=cfg)
    for step in range(STEPS):
        for m in range(GA):
            xb, yb = (micro_batch(t, step, m, rank, world, micro_bs) for t in (x, y))
            first, second = engine(xb, yb), engine(xb, _labels(yb))  # two forwards, two graphs
            engine.backward(first)
            engine.backward(second)
            engine.step()
    out = gathered_weights(engine)
    engine.destroy()
    return out


def _two_tasks(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, y) + model(x, _labels(y))


@pytest.mark.parametrize("zero", [
    {"stage": 0}, {"stage": 1}, {"stage": 2}, {"stage": 3, "stage3_param_persistence_threshold": 0},
    {"stage": 1, "offload_optimizer": {"device": "cpu"}},
], ids=["stage0", "stage1", "stage2", "stage3", "stage1-cpu-offload"])
def test_two_backward_calls_per_micro_step(zero: dict, tmp_path: Path) -> None:
    results = run_distributed(worker, WORLD, zero, str(tmp_path))
    ref = reference_by_micro_batch(_two_tasks, STEPS, GA, GLOBAL_BATCH, WORLD, LR, CLIP)
    for r in results:
        assert relative_distance(r, ref) <= TOL, relative_distance(r, ref)
