"""Determinism: the same config, data and seed give bit-identical training on CPU, run to run.

Two independent jobs (two spawns of 2 gloo ranks each) train the same dropout model at every
ZeRO stage in fp32 and bf16, with gradient accumulation, clipping, overlapped communication,
several buckets per step and, at stage 3, a live budget small enough that units are released and
gathered again in backward. Each job trains every configuration twice in a row, so state leaking
from one engine into the next would show too. Every loss, every rank's fp32 master shard and the
gathered module parameters must be bit for bit equal (``torch.equal``) across all four runs.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from models import make_data, micro_batch

import zeroshard

STAGES = (0, 1, 2, 3)
PRECISIONS = ("fp32", "bf16")
GLOBAL_BATCH, GA, STEPS = 24, 3, 3
SEED = 1234


class DropoutNet(torch.nn.Module):
    """:class:`models.ToyNet`'s shapes (odd sizes, split unevenly over 2 ranks) plus dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(11, 37)
        self.norm = torch.nn.LayerNorm(37)
        self.drop = torch.nn.Dropout(0.2)
        self.hidden = torch.nn.Linear(37, 29)
        self.out = torch.nn.Linear(29, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.nn.functional.gelu(self.norm(self.embed(x))))
        return torch.nn.functional.cross_entropy(self.out(torch.tanh(self.hidden(h))).float(), y)


def config(stage: int, precision: str) -> dict:
    return {
        "train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": GA, "gradient_clipping": 1.0,
        "bf16": {"enabled": precision == "bf16"},
        "zero_optimization": {"stage": stage, "overlap_comm": True, "reduce_bucket_size": 600,
                              "allgather_bucket_size": 900, "stage3_param_persistence_threshold": 0,
                              "stage3_max_live_parameters": 500, "stage3_prefetch_bucket_size": 1200},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2, "warmup_max_lr": 1e-2}},
    }


def train(rank: int, world: int, stage: int, precision: str) -> dict[str, object]:
    torch.manual_seed(SEED)  # the same initial weights on every rank (rank 0's are broadcast anyway)
    model = DropoutNet()
    engine, *_ = zeroshard.initialize(model=model, config=config(stage, precision))
    torch.manual_seed(SEED + rank)  # each rank its own dropout masks, the same in every run
    x, y = make_data(STEPS, GLOBAL_BATCH)
    micro_bs = GLOBAL_BATCH // (GA * world)
    losses = []
    for step in range(STEPS):
        for m in range(GA):
            loss = engine(*(micro_batch(t, step, m, rank, world, micro_bs) for t in (x, y)))
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float().clone())
    masters = [m.detach().clone() for m in engine.optimizer.master.views.values()]
    with engine.gathered():
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "masters": masters, "params": params}


def worker(rank: int, world: int) -> dict[str, object]:
    return {f"s{stage}/{precision}/{run}": train(rank, world, stage, precision)
            for stage in STAGES for precision in PRECISIONS for run in (0, 1)}


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.timeout(300)
def test_runs_are_bit_identical_at_every_stage() -> None:
    jobs = [run_distributed(worker, 2, timeout=240) for _ in range(2)]
    for stage in STAGES:
        for precision in PRECISIONS:
            runs = [job[rank][f"s{stage}/{precision}/{run}"] for job in jobs for run in (0, 1) for rank in (0, 1)]
            rank0, rank1 = runs[0::2], runs[1::2]
            what = f"stage {stage} {precision}"
            first = rank0[0]["losses"]
            assert len({round(float(v), 3) for v in first}) > 1, f"{what}: the loss never changed"
            for rank, results in ((0, rank0), (1, rank1)):
                for i, other in enumerate(results[1:], 1):
                    for key in ("losses", "masters", "params"):
                        assert _equal(results[0][key], other[key]), f"{what}: rank {rank}, run {i} differs in {key}"
            assert _equal(rank0[0]["params"], rank1[0]["params"]), f"{what}: ranks hold different parameters"
