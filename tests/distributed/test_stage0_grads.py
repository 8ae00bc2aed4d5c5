"""Stage 0's ``.grad`` between ``engine.backward`` and ``engine.step``, as DeepSpeed's stage 0 and DDP
leave it: this rank's accumulated gradient between micro-steps, the averaged one after the window's
last backward. Scripts read it (``p.grad.norm()``), clip it by hand (``clip_grad_norm_`` over
``engine.module.parameters()``), replace it, set it to ``None`` to skip a parameter, or erase it
mid-window with ``engine.module.zero_grad()``. Before, ``.grad`` was ``None`` there: the hand
clipping did nothing (it returned 0.0 and the step trained unclipped), ``p.grad.norm()`` raised, and
``.grad = None`` and ``module.zero_grad()`` were ignored.

2 ranks, accumulation 2, odd parameter sizes; plain PyTorch with the same edits is the reference.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from models import gathered_weights, make_data, make_model, micro_batch, relative_distance

import zeroshard

STEPS, GA, GLOBAL_BATCH, LR, MAX_NORM, WORLD = 5, 2, 8, 1e-2, 0.05, 2
TOL = 1e-5
#: the optimizer step whose first micro-step's gradients the script erases with module.zero_grad()
ERASED = 3


def _edit(model: torch.nn.Module, step: int) -> tuple[float, list[float]]:
    """What the script does to the averaged gradients before the step: the per-parameter norms it
    logs, clipping by hand, then at step 1 skipping a parameter and at step 2 replacing a gradient."""
    norms = [float(p.grad.norm()) for p in model.parameters()]
    total = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    if step == 1:
        model.hidden.weight.grad = None
    if step == 2:
        model.out.weight.grad = model.out.weight.grad * 3.0
    return total, norms


def worker(rank: int, world: int) -> tuple[dict[str, torch.Tensor], list[tuple[float, list[float]]], list[list[float]]]:
    x, y = make_data(STEPS, GLOBAL_BATCH)
    micro_bs = GLOBAL_BATCH // (GA * world)
    cfg = {"train_micro_batch_size_per_gpu": micro_bs, "gradient_accumulation_steps": GA,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 0}}
    engine, *_ = zeroshard.initialize(model=make_model(0), config=cfg)
    logged, local = [], []
    for step in range(STEPS):
        for m in range(GA):
            xb, yb = (micro_batch(t, step, m, rank, world, micro_bs) for t in (x, y))
            engine.backward(engine(xb, yb))
            if engine.is_gradient_accumulation_boundary():
                logged.append(_edit(engine.module, step))
            else:  # this rank's own gradient so far, as DDP's .grad between micro-steps
                local.append([float(p.grad.norm()) for p in engine.module.parameters()])
                if step == ERASED:
                    engine.module.zero_grad()
            engine.step()
    assert all(p.grad is None for p in engine.module.parameters())  # the step took them
    out = gathered_weights(engine)
    engine.destroy()
    return out, logged, local


def _reference() -> tuple[dict[str, torch.Tensor], list[tuple[float, list[float]]], list[list[list[float]]]]:
    """Plain PyTorch over the global batch; ``local[r]``: rank r's first micro-step gradient norms."""
    model = make_model(0)
    x, y = make_data(STEPS, GLOBAL_BATCH)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    micro_bs = GLOBAL_BATCH // (GA * WORLD)
    logged: list[tuple[float, list[float]]] = []
    local: list[list[list[float]]] = [[] for _ in range(WORLD)]
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(GA):
            for r in range(WORLD):
                xb, yb = (micro_batch(t, step, m, r, WORLD, micro_bs) for t in (x, y))
                loss = model(xb, yb) / GA
                if m == 0:
                    local[r].append([float(g.norm()) for g in torch.autograd.grad(loss, list(model.parameters()),
                                                                                  retain_graph=True)])
                (loss / WORLD).backward()
            if m == 0 and step == ERASED:
                opt.zero_grad()  # every rank erased its first micro-step
        logged.append(_edit(model, step))
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, logged, local


def test_stage0_grad_is_pytorchs_and_scripts_can_edit_it() -> None:
    results = run_distributed(worker, WORLD)
    ref, ref_logged, ref_local = _reference()
    for rank, (weights, logged, local) in enumerate(results):
        for step, (norms, ref_norms) in enumerate(zip(local, ref_local[rank])):
            assert norms == pytest.approx(ref_norms, rel=TOL), ("between micro-steps", rank, step)
        for step, ((total, norms), (ref_total, ref_norms)) in enumerate(zip(logged, ref_logged)):
            assert total == pytest.approx(ref_total, rel=TOL), step
            assert norms == pytest.approx(ref_norms, rel=TOL), step
        assert relative_distance(weights, ref) <= TOL, relative_distance(weights, ref)
