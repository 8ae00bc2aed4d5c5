"""ZeRO-3 with the optimizer state on NVMe steps its sub-groups as the next forward gathers their
units, so that the step's swap-file reads and writes overlap that forward
(``SwappedStateStore.begin_step``). Checked in real 2-rank runs against the same training with the
state in memory: the same bits with a learning-rate schedule that changes the rate every step (each
deferred sub-group steps with the rate of its step, not the scheduler's next one), with persistent
units and without; the step really is left pending when ``engine.step()`` returns; and a reader of
the masters right after the step (``safe_get_full_fp32_param``) sees the stepped values."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from test_offload_parity import GA, MB, STEPS, _data, _model, _uses_extra

import zeroshard
from zeroshard.deepspeed.utils import safe_get_full_fp32_param


def _config(nvme: str | None, persistent: bool) -> dict[str, Any]:
    z: dict[str, Any] = {"stage": 3, "reduce_bucket_size": 600, "sub_group_size": 700,
                         "stage3_param_persistence_threshold": 10**5 if persistent else 0,
                         "stage3_max_live_parameters": 2000, "stage3_prefetch_bucket_size": 1500}
    if nvme is not None:
        z["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 2}
        z["offload_param"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 2, "buffer_size": 5000}
    return {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GA, "gradient_clipping": 0.05,
            "zero_optimization": z, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                         "warmup_num_steps": STEPS, "warmup_type": "linear"}}}


def _train(cfg: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    x, y = _data()
    engine, *_ = zeroshard.initialize(model=_model(), config=cfg)
    store = engine.optimizer.store
    pending, seen = [], []
    for step in range(STEPS):
        for m in range(GA):
            i = ((step * GA + m) * world + rank) * MB
            engine.backward(F.mse_loss(engine(x[i : i + MB], _uses_extra(step)).float(), y[i : i + MB]))
            engine.step()
        pending.append(bool(getattr(store, "step_pending", False)))
        if step % 7 == 3:  # read right after the step, before any forward has gathered anything
            seen.append(safe_get_full_fp32_param(engine.module.b.weight).clone())
    weights = [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]
    engine.destroy()
    return {"weights": weights, "pending": pending, "seen": seen}


def worker(rank: int, world: int, nvme: str) -> dict[str, Any]:
    return {persistent: {kind: _train(_config(nvme if kind == "nvme" else None, persistent), rank, world)
                         for kind in ("memory", "nvme")}
            for persistent in (False, True)}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(worker, 2, str(tmp_path_factory.mktemp("nvme")), timeout=600)


@pytest.mark.parametrize("persistent", [False, True])
def test_step_overlapping_the_next_forward_trains_the_same_bits(results: list[dict[str, Any]],
                                                                persistent: bool) -> None:
    for r in results:
        mem, nv = r[persistent]["memory"], r[persistent]["nvme"]
        assert all(nv["pending"]) and not any(mem["pending"]), (nv["pending"], mem["pending"])
        assert all(torch.equal(a, b) for a, b in zip(nv["seen"], mem["seen"])) and nv["seen"]
        for a, b in zip(nv["weights"], mem["weights"]):
            assert torch.equal(a, b), (a - b).abs().max()
