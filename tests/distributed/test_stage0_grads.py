"""Stage 0's ``.grad`` between ``engine.backward`` and ``engine.step``, as DeepSpeed's stage 0 and DDP
leave it: the averaged gradient, which scripts read (``p.grad.norm()``), clip by hand
(``clip_grad_norm_`` over ``engine.module.parameters()``), replace, or set to ``None`` to skip a
parameter. Before, ``.grad`` was ``None`` there: the hand clipping did nothing (it returned 0.0 and
the step trained unclipped), ``p.grad.norm()`` raised and ``.grad = None`` was ignored.

2 ranks, accumulation 2, odd parameter sizes; plain PyTorch with the same hand edits is the reference.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from models import gathered_weights, make_data, make_model, micro_batch, relative_distance

import zeroshard

STEPS, GA, GLOBAL_BATCH, LR, MAX_NORM, WORLD = 4, 2, 8, 1e-2, 0.05, 2
TOL = 1e-5


def _edit(model: torch.nn.Module, step: int) -> tuple[float, list[float]]:
    """What the script does to the gradients before the step: the per-parameter norms it logs,
    clipping by hand, then at step 1 skipping a parameter and at step 2 replacing a gradient."""
    norms = [float(p.grad.norm()) for p in model.parameters()]
    total = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    if step == 1:
        model.hidden.weight.grad = None
    if step == 2:
        model.out.weight.grad = model.out.weight.grad * 3.0
    return total, norms


def worker(rank: int, world: int) -> tuple[dict[str, torch.Tensor], list[tuple[float, list[float]]], list[bool]]:
    x, y = make_data(STEPS, GLOBAL_BATCH)
    micro_bs = GLOBAL_BATCH // (GA * world)
    cfg = {"train_micro_batch_size_per_gpu": micro_bs, "gradient_accumulation_steps": GA,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 0}}
    engine, *_ = zeroshard.initialize(model=make_model(0), config=cfg)
    logged, between = [], []
    for step in range(STEPS):
        for m in range(GA):
            xb, yb = (micro_batch(t, step, m, rank, world, micro_bs) for t in (x, y))
            engine.backward(engine(xb, yb))
            if engine.is_gradient_accumulation_boundary():
                logged.append(_edit(engine.module, step))
            else:
                between.append(all(p.grad is None for p in engine.module.parameters()))
            engine.step()
    between.append(all(p.grad is None for p in engine.module.parameters()))  # the step took them
    out = gathered_weights(engine)
    engine.destroy()
    return out, logged, between


def _reference() -> tuple[dict[str, torch.Tensor], list[tuple[float, list[float]]]]:
    model = make_model(0)
    x, y = make_data(STEPS, GLOBAL_BATCH)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    micro_bs = GLOBAL_BATCH // (GA * WORLD)
    logged = []
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(GA):
            for r in range(WORLD):
                xb, yb = (micro_batch(t, step, m, r, WORLD, micro_bs) for t in (x, y))
                (model(xb, yb) / (GA * WORLD)).backward()
        logged.append(_edit(model, step))
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, logged


def test_stage0_grad_is_the_averaged_gradient_scripts_can_edit() -> None:
    results = run_distributed(worker, WORLD)
    ref, ref_logged = _reference()
    for weights, logged, between in results:
        assert all(between), "stage 0 shows .grad only once it is reduced, and the step takes it"
        for step, ((total, norms), (ref_total, ref_norms)) in enumerate(zip(logged, ref_logged)):
            assert total == pytest.approx(ref_total, rel=TOL), step
            assert norms == pytest.approx(ref_norms, rel=TOL), step
        assert relative_distance(weights, ref) <= TOL, relative_distance(weights, ref)
