"""NaN and Inf gradients: detected on every rank together, the step skipped with a warning naming
the step and the first parameter, or an error (``non_finite_gradients: raise``).

Rank 1 poisons one gradient element of ``hidden.weight`` (through a hook) in one micro-step of
step 2; the other rank's gradients are finite, so only the all-reduced norm tells it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import log_lines, run_distributed
from models import make_data, make_model, micro_batch, train_reference

import zeroshard
from zeroshard.config import load_config
from zeroshard.errors import ConfigError

STEPS, GA, BATCH, POISONED = 4, 2, 8, 2


def config(stage: int, precision: str, policy: str) -> dict:
    return {
        "train_batch_size": BATCH, "gradient_accumulation_steps": GA, "gradient_clipping": 1.0,
        "bf16": {"enabled": precision == "bf16"}, "non_finite_gradients": policy,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    }


def worker(rank: int, world: int, policy: str) -> dict:
    x, y = make_data(STEPS, BATCH)
    out: dict = {}
    records = log_lines()
    for stage in (0, 1, 2, 3):
        for precision in ("fp32", "bf16"):
            model = make_model(0)
            engine, *_ = zeroshard.initialize(model=model, config=config(stage, precision, policy))
            current = {"step": 0}

            def poison(grad: torch.Tensor, current: dict = current) -> torch.Tensor:
                if rank == 1 and current["step"] == POISONED:
                    grad = grad.clone()
                    grad.view(-1)[3] = float("nan")
                return grad

            model.hidden.weight.register_hook(poison)
            key = f"{stage}/{precision}"
            try:
                for step in range(STEPS):
                    current["step"] = step
                    for m in range(GA):
                        xb, yb = (micro_batch(t, step, m, rank, world, BATCH // (GA * world)) for t in (x, y))
                        engine.backward(engine(xb, yb))
                        engine.step()
            except FloatingPointError as e:
                out[key] = {"error": str(e), "step": engine.global_steps}
                continue
            with engine.gathered():
                params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
            out[key] = {"params": params, "skipped": engine.skipped_steps}
    out["log"] = records
    return out


def test_skip_names_the_step_and_parameter() -> None:
    results = run_distributed(worker, 2, "skip")
    ref = train_reference(make_model(0), *make_data(STEPS, BATCH), lr=1e-2, clip=1.0,
                          skip_steps=frozenset({POISONED}))
    flat_ref = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    for key, res in results[0].items():
        if key == "log":
            continue
        assert res["skipped"] == 1, (key, res)
        if key.endswith("fp32"):  # the skipped step is exactly plain PyTorch skipping it
            flat = torch.cat([res["params"][n].reshape(-1) for n, _ in ref.named_parameters()])
            assert ((flat - flat_ref).norm() / flat_ref.norm()).item() <= 1e-5, key
        assert all(torch.isfinite(t).all() for t in res["params"].values()), key
    warnings = [m for m in results[0]["log"] if "not finite" in m]
    assert len(warnings) == 8, results[0]["log"]  # once per stage and precision, from rank 0
    assert all(f"optimizer step {POISONED}" in m and "hidden.weight" in m for m in warnings), warnings
    assert not [m for m in results[1]["log"] if "not finite" in m], "only rank 0 warns"


def test_raise_names_the_step_and_parameter_on_every_rank() -> None:
    results = run_distributed(worker, 2, "raise")
    for rank_result in results:
        for key, res in rank_result.items():
            if key == "log":
                continue
            assert "error" in res, (key, res)
            assert f"optimizer step {POISONED}" in res["error"] and "hidden.weight" in res["error"], res["error"]


def test_unknown_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="non_finite_gradients"):
        load_config(config(0, "fp32", "ignore"), world_size=1)


def ignore_worker(rank: int, world: int) -> dict:
    """bf16 with ``check_grad_overflow: false``: the poisoned step is applied, as DeepSpeed does."""
    x, y = make_data(STEPS, BATCH)
    records = log_lines()
    out: dict = {}
    for stage in (0, 1, 2, 3):
        cfg = config(stage, "bf16", "skip")
        cfg["bf16"]["check_grad_overflow"] = False
        model = make_model(0)
        engine, *_ = zeroshard.initialize(model=model, config=cfg)

        def poison(g: torch.Tensor, engine: Any = engine) -> torch.Tensor:
            hit = rank == 1 and engine.global_steps == POISONED
            return g.index_fill(0, torch.tensor([1]), float("nan")) if hit else g

        model.hidden.weight.register_hook(poison)
        finite_after = []
        for step in range(STEPS):
            for m in range(GA):
                xb, yb = (micro_batch(t, step, m, rank, world, BATCH // (GA * world)) for t in (x, y))
                engine.backward(engine(xb, yb))
                engine.step()
            with engine.gathered():
                finite_after.append(all(bool(torch.isfinite(p).all()) for p in engine.module.parameters()))
        out[stage] = {"skipped": engine.skipped_steps, "finite_after": finite_after}
        engine.destroy()
    out["log"] = records
    return out


def test_bf16_check_grad_overflow_false_applies_the_step() -> None:
    """DeepSpeed's test_zero_optim_overflow.py::test_ignore_grad_overflow: nothing is skipped, and the
    parameters hold NaN from the poisoned step on; initialize said it would be so."""
    results = run_distributed(ignore_worker, 2)
    for rank, res in enumerate(results):
        for stage in (0, 1, 2, 3):
            assert res[stage]["skipped"] == 0, (rank, stage, res[stage])
            assert res[stage]["finite_after"] == [i < POISONED for i in range(STEPS)], (rank, stage, res[stage])
    said = [m for m in results[0]["log"] if "check_grad_overflow is false" in m]
    assert len(said) == 4, results[0]["log"]
    assert not [m for m in results[1]["log"] if "check_grad_overflow is false" in m], "only rank 0 warns"


def test_check_grad_overflow_false_with_raise_is_a_config_error() -> None:
    cfg = config(2, "bf16", "raise")
    cfg["bf16"]["check_grad_overflow"] = False
    with pytest.raises(ConfigError) as e:
        load_config(cfg, world_size=1)
    assert e.value.key == "bf16.check_grad_overflow"
