"""Parameters of the shapes real models have that flat ZeRO buffers handle at their edges.

A parameter with no elements (an optional prefix or adapter of length 0: ``zeros(11, 0)``), alone in
its ZeRO-3 unit or beside others; a 0-dim one (CLIP's ``logit_scale``); one made from a transposed,
non-contiguous tensor. Before the fix, ZeRO-3 crashed gathering a unit of one empty parameter
(``AssertionError`` in the all-gather's landing buffer), a stage-3 save recorded ``(11, 0)`` as
``(0,)``, and no checkpoint holding an empty trained parameter loaded at all (``IndexError`` reading
its ``step``, which no rank had saved). Every stage on 2 ranks trains to plain PyTorch's
parameters, saves, and resumes on another stage and world size to train on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from models import gathered_weights, make_data, micro_batch, reference_by_micro_batch, relative_distance
from torch import nn

import zeroshard

SAVED_STEPS, STEPS, GA, GLOBAL_BATCH, LR, CLIP = 3, 5, 2, 8, 1e-2, 1.0
TOL = 1e-5


class _EmptyAdapter(nn.Module):
    """A module whose only parameter has no elements: at ZeRO-3, a unit of nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(7, 0))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h @ self.weight).sum(-1, keepdim=True)


class OddNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(11, 7)
        self.adapter = _EmptyAdapter()
        self.empty = nn.Parameter(torch.zeros(11, 0))  # beside other parameters in the root's unit
        self.logit_scale = nn.Parameter(torch.tensor(0.5))
        self.mix = nn.Parameter(torch.randn(5, 7).t())  # (7, 5), not contiguous
        self.out = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        h = h + self.adapter(h) + (x @ self.empty).sum(-1, keepdim=True)
        logits = self.out(torch.tanh(h @ self.mix)) * self.logit_scale.exp()
        return F.cross_entropy(logits, y)


def make_odd() -> OddNet:
    torch.manual_seed(0)
    return OddNet()


def _config(stage: int, world: int) -> dict:
    zero: dict = {"stage": stage}
    if stage == 3:  # every unit sharded and released, so each is gathered at its forward
        zero.update(stage3_param_persistence_threshold=0, stage3_max_live_parameters=0)
    return {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // (GA * world), "gradient_accumulation_steps": GA,
            "gradient_clipping": CLIP, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}}


def worker(rank: int, world: int, stage: int, ckpt: str, resume: bool) -> dict:
    x, y = make_data(STEPS, GLOBAL_BATCH)
    micro_bs = GLOBAL_BATCH // (GA * world)
    model = make_odd()
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=_config(stage, world))
    steps = range(SAVED_STEPS)
    if resume:
        engine.load_checkpoint(ckpt)
        steps = range(SAVED_STEPS, STEPS)
    for step in steps:
        for m in range(GA):
            xb, yb = (micro_batch(t, step, m, rank, world, micro_bs) for t in (x, y))
            engine.backward(engine(xb, yb))
            engine.step()
    if not resume:
        engine.save_checkpoint(ckpt, tag="odd")
    out = gathered_weights(engine)
    engine.destroy()
    return out


def _reference(steps: int) -> dict[str, torch.Tensor]:
    return reference_by_micro_batch(lambda model, x, y: model(x, y), steps, GA, GLOBAL_BATCH, 2, LR, CLIP,
                                    model_fn=make_odd, data=make_data(STEPS, GLOBAL_BATCH))


@pytest.mark.parametrize("stage,resume_stage,resume_world", [(0, 3, 2), (1, 2, 1), (2, 0, 2), (3, 1, 1)])
def test_empty_0dim_and_strided_parameters_train_save_and_resume(stage: int, resume_stage: int, resume_world: int,
                                                                  tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(worker, 2, stage, ckpt, False)
    ref = _reference(SAVED_STEPS)
    for rank, got in enumerate(saved):
        assert {n: tuple(t.shape) for n, t in got.items()} == {n: tuple(t.shape) for n, t in ref.items()}
        dist = relative_distance(got, ref)
        assert dist <= TOL, f"stage {stage}, rank {rank}: {dist:.2e} from plain PyTorch"
    resumed = run_distributed(worker, resume_world, resume_stage, ckpt, True)
    ref = _reference(STEPS)
    for rank, got in enumerate(resumed):
        assert got["empty"].shape == (11, 0) and got["adapter.weight"].shape == (7, 0)
        dist = relative_distance(got, ref)
        assert dist <= TOL, (f"saved at stage {stage}, resumed at stage {resume_stage} on {resume_world} rank(s), "
                             f"rank {rank}: {dist:.2e} from plain PyTorch")
