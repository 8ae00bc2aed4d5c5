"""Offload changes where state lives, never the training: parity with the in-memory run.

For each stage, precision and offload choice, a run with masters and optimizer state in host
memory (``offload_optimizer: cpu``) or in NVMe swap files (``nvme``), and at stage 3 parameter
shards in host memory or a swap file, must reach *bit-identical* parameters to the in-memory run
of the same stage: the torch optimizer is elementwise, and stepping it sub-group by sub-group on
the same values gives the same bits. 30 optimizer steps with gradient accumulation and clipping,
sizes that do not divide by the world size, small buckets and sub-groups (many sub-groups, so the
read-ahead/write-behind pipeline and slot reuse are exercised), and a branch that some windows do
not use at all (its optimizer state must stay untouched in the swap file, as plain PyTorch leaves
it). ZeRO-3 with everything on NVMe also runs with a live budget that holds the whole model, where
the optimizer state is read ahead during backward (no parameter is read from the disk there); with
the small budget, backward reads parameters again and the read-ahead waits for the step. The
in-memory runs themselves are checked against plain PyTorch elsewhere
(``test_parity.py``, ``test_partial_grads.py``, with one sub-group); here, with many, each stage's
in-memory run is compared with plain PyTorch too (stages 1-2 start each sub-group's parameter
all-gather as soon as it is stepped).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from torch import nn

import zeroshard
from zeroshard.deepspeed.utils import safe_get_full_fp32_param

DIM, HID, OUT, STEPS, GA, MB, LR, CLIP = 13, 37, 5, 30, 2, 3, 1e-2, 0.05
#: the ``extra`` branch runs in windows where step % 3 == 1 (every rank, both micro-steps)
def _uses_extra(step: int) -> bool:
    return step % 3 == 1


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, HID)
        self.b = nn.Linear(HID, HID)
        self.extra = nn.Linear(HID, HID)
        self.c = nn.Linear(HID, OUT)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h))
        if use_extra:
            h = h + self.extra(h)
        return self.c(h)


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    n = STEPS * GA * MB * 2
    return torch.randn(n, DIM, generator=g), torch.randn(n, OUT, generator=g)


def _config(stage: int, dtype: str, opt: str, param: str, nvme: str, whole_live: bool = False) -> dict[str, Any]:
    z: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 600, "sub_group_size": 700,
                         "stage3_param_persistence_threshold": 0,
                         "stage3_max_live_parameters": 10**9 if whole_live else 2000,
                         "stage3_prefetch_bucket_size": 1500}
    if opt != "none":
        z["offload_optimizer"] = {"device": opt, "nvme_path": nvme, "buffer_count": 3}
    if param != "none":
        z["offload_param"] = {"device": param, "nvme_path": nvme, "buffer_count": 2, "buffer_size": 5000}
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GA,
                           "gradient_clipping": CLIP, "zero_optimization": z,
                           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _train(cfg: dict[str, Any], rank: int, world: int) -> tuple[list[torch.Tensor], dict[str, Any]]:
    x, y = _data()
    model = _model()
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    io = getattr(engine.optimizer.store, "io", None)  # the optimizer state's swap-file I/O engine
    read_in_backward = 0
    for step in range(STEPS):
        for m in range(GA):
            i = ((step * GA + m) * world + rank) * MB
            out = engine(x[i : i + MB], _uses_extra(step))
            # Reads started during backward (requested, not finished: a busy disk finishes them later)
            before = io.bytes_read_requested if io is not None else 0
            engine.backward(F.mse_loss(out.float(), y[i : i + MB]))
            read_in_backward += (io.bytes_read_requested - before) if io is not None else 0
            engine.step()
    weights = [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]  # type: ignore[union-attr]
    placement = dict(engine.optimizer.memory_placement(), read_in_backward=read_in_backward)
    engine.destroy()
    return weights, placement


def _reference(world: int) -> list[torch.Tensor]:
    """Plain PyTorch, one process, the same global batches (fp32)."""
    x, y = _data()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for m in range(GA):
            for r in range(world):
                i = ((step * GA + m) * world + r) * MB
                loss = F.mse_loss(model(x[i : i + MB], _uses_extra(step)), y[i : i + MB])
                (loss / (GA * world)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


#: (stage, optimizer offload, parameter offload)
CASES = [(1, "cpu", "none"), (1, "nvme", "none"), (2, "cpu", "none"), (2, "nvme", "none"),
         (3, "cpu", "none"), (3, "nvme", "none"), (3, "cpu", "cpu"), (3, "nvme", "nvme"), (3, "none", "nvme"),
         (3, "nvme", "nvme", "whole model live")]


def parity_worker(rank: int, world: int, dtypes: list[str], nvme: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # Every rank names the same nvme_path (configs must agree); each gets its own swap directory.
    for dtype in dtypes:
        refs = {s: _train(_config(s, dtype, "none", "none", nvme), rank, world)[0] for s in (1, 2, 3)}
        if dtype == "fp32":
            plain = _reference(world)
            out["plain"] = {s: max(float((a - b).norm() / b.norm()) for a, b in zip(refs[s], plain)) for s in refs}
        for stage, opt, param, *live in CASES:
            cfg = _config(stage, dtype, opt, param, nvme, whole_live=bool(live))
            weights, placement = _train(cfg, rank, world)
            same = all(torch.equal(a, b) for a, b in zip(weights, refs[stage]))
            dist = max(float((a - b).norm() / b.norm()) for a, b in zip(weights, refs[stage]))
            out[f"{dtype} stage {stage} optimizer {opt} params {param}{', ' + live[0] if live else ''}"] = (
                same, dist, placement)
    torch.distributed.barrier()  # every rank has destroyed its last engine
    out["leftover"] = sorted(os.listdir(nvme))  # swap directories removed by destroy()
    return out


def _check(results: dict[str, Any], world: int) -> None:
    for stage, d in results["plain"].items():  # many sub-groups: each one's all-gather starts after its step
        assert d <= 1e-5, f"in-memory stage {stage} vs plain PyTorch: {d:.2e}"
    assert results["leftover"] == [], f"swap files left behind after destroy(): {results['leftover']}"
    bad = {k: v[1] for k, v in results.items() if isinstance(v, tuple) and not v[0]}
    assert not bad, f"world {world}: not bit-identical to the in-memory run: {bad}"
    for k, (_same, _dist, placement) in ((k, v) for k, v in results.items() if isinstance(v, tuple)):
        if "optimizer nvme" in k:
            assert placement["optimizer_states"].get("file", 0) > 0, (k, placement)
        if "params nvme" in k:
            assert placement["parameter_shard"].get("file", 0) > 0, (k, placement)
        # Optimizer state is read ahead during backward unless backward reads parameters from the disk.
        if "optimizer nvme" in k:
            ahead = "params nvme" not in k or "whole model live" in k
            assert (placement["read_in_backward"] > 0) == ahead, (k, placement["read_in_backward"])


@pytest.mark.parametrize("world", [1, 2])
def test_offload_is_bit_identical_to_in_memory(world: int, tmp_path: Path) -> None:
    dtypes = ["fp32", "bf16"] if world == 2 else ["fp32"]
    for results in run_distributed(parity_worker, world, dtypes, str(tmp_path), timeout=600):
        _check(results, world)
