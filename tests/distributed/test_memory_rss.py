"""What ZeRO shards away shows in each rank's real resident memory, not only in memory_usage().

Every figure is growth of the rank's own RSS (``/proc/self/status``: VmHWM for the peak, reset
through ``/proc/self/clear_refs``; VmRSS for the current value) over a baseline taken just before
the model is built, so the spawned process's torch import and gloo set-up are not counted. A small
warm-up run before the baseline loads the code paths (shared-library pages count in RSS too).

- ``zero.Init`` grows each rank by about 1/N of the fp32 model plus the largest parameter: at
  most 60% of the model on 2 ranks (issue #9 measured 150-180% before).
- Training peaks (fp32, AdamW, 2 ranks, micro batch 2 x 128 tokens x 2 accumulation, 3 steps)
  are below torch DDP's on the same model and data by at least 60% of the model-state bytes each
  stage shards away: stage 1 4Ψ, stage 2 6Ψ, stage 3 8Ψ bytes (Ψ parameters). Each system
  runs in its own spawned job, with zeroshard's defaults (ZeRO-3 trims the heap as it releases
  units; stages 1-2 do not trim in training).
  Stage 3 runs at its default live budget (the whole 25M model stays gathered through the step)
  and at the setting that matches FSDP2's ``reshard_after_forward=True`` (README, "Memory");
  zeroshard's reduce buckets are 2M elements. Before zeroshard kept its own large buffers and
  gloo's all-gathers out of malloc's heap, this held only with ``ZEROSHARD_MALLOC_TRIM=1``
  (docs/performance.md).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import rss
import torch
from harness import run_distributed

import zeroshard

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")

MiB = 2**20
#: stage 3 as FSDP2 with ``reshard_after_forward=True``: units released after use, one block
#: (3.15M parameters here) gathered ahead
RESHARD = {"stage3_max_live_parameters": 3_200_000, "stage3_prefetch_bucket_size": 3_200_000}


_status = rss.status
_baseline = rss.reset_peak


def _growth(base: dict[str, int]) -> dict[str, int]:
    now = _status()
    return {"peak": now["VmHWM"] - base["VmRSS"], "current": now["VmRSS"] - base["VmRSS"]}


class _Tied(torch.nn.Module):
    """Initialisers that read parameters: a copy from another parameter, in-place scaling."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(33, 17), torch.nn.Linear(33, 17)
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight)  # both partitioned: both must be whole at once
            self.b.bias.mul_(3.0).add_(self.a.bias)
            self.a.weight.normal_()  # overwritten without a gather


def _same_under_init() -> bool:
    from zeroshard.zero.init import materialize_init_params

    torch.manual_seed(1)
    plain = _Tied()
    torch.manual_seed(1)
    with zeroshard.zero.Init():
        lazy = _Tied()
    materialize_init_params(lazy, None)
    return all(torch.equal(x, y) for x, y in zip(plain.state_dict().values(), lazy.state_dict().values()))


def init_worker(rank: int, world: int) -> dict[str, int]:
    with zeroshard.zero.Init():  # warm-up: code paths, gloo buffers
        GPT(GPTConfig(n_layer=1, n_head=2, n_embd=64))
    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=12, n_head=12, n_embd=768)
    base = _baseline()
    torch.manual_seed(0)
    with zeroshard.zero.Init():
        model = GPT(cfg)
    out = _growth(base)
    shapes = [p._zeroshard_shape for p in model.parameters()]
    out["model"] = 4 * sum(s.numel() for s in shapes)
    out["largest"] = 4 * max(s.numel() for s in shapes)
    out["same_values"] = int(_same_under_init())
    return out


def test_zero_init_holds_a_shard_not_the_model() -> None:
    for rank, r in enumerate(run_distributed(init_worker, 2, timeout=600)):
        model = r["model"]  # 85M parameters: 326 MiB in fp32
        print(f"rank {rank}: zero.Init peak {r['peak'] / MiB:.0f} MiB, current {r['current'] / MiB:.0f} MiB, "
              f"model {model / MiB:.0f} MiB")
        assert r["peak"] <= 0.6 * model, f"rank {rank}: peak grew {r['peak'] / MiB:.0f} MiB, model {model / MiB:.0f}"
        assert r["current"] <= 0.6 * model, f"rank {rank}: {r['current'] / MiB:.0f} MiB held after zero.Init"
        assert r["same_values"], "zero.Init changed the values that initialisers reading parameters produce"


# -- training peaks -------------------------------------------------------------------------------
GPT_25M = GPTConfig(vocab_size=256, block_size=128, n_layer=8, n_head=8, n_embd=512)
MICRO, ACCUM, STEPS = 2, 2, 3


def _batches(rank: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(rank)
    return [[(torch.randint(0, 256, (MICRO, 128), generator=g), torch.randint(0, 256, (MICRO, 128), generator=g))
             for _ in range(ACCUM)] for _ in range(STEPS)]


def _warm_up(system: str, stage: int) -> None:
    """One step of a tiny model through the same code paths, so that their pages are in the baseline."""
    tiny = GPTConfig(vocab_size=256, block_size=128, n_layer=1, n_head=2, n_embd=64)
    _train(system, stage, tiny, [_batches(0)[0]], {})


def _train(system: str, stage: int, cfg: GPTConfig, batches: list[Any], zero: dict[str, Any]) -> int:
    torch.manual_seed(0)
    model = GPT(cfg)
    psi = sum(p.numel() for p in model.parameters())
    if system == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        for step in batches:
            for i, (x, y) in enumerate(step):
                if i < len(step) - 1:
                    with ddp.no_sync():
                        (ddp(x, y) / len(step)).backward()
                else:
                    (ddp(x, y) / len(step)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return psi
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
              "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 2_000_000,
                                    "allgather_bucket_size": 2_000_000, **zero}}
    engine, *_ = zeroshard.initialize(model=model, config=config)
    for step in batches:
        for x, y in step:
            engine.backward(engine(x, y))
            engine.step()
    return psi


def train_worker(rank: int, world: int, system: str, stage: int, reshard: bool = False) -> dict[str, int]:
    os.environ.pop("ZEROSHARD_MALLOC_TRIM", None)  # what users get: zeroshard's default trimming
    zero = RESHARD if reshard else {}
    _warm_up(system, stage)
    batches = _batches(rank)
    base = _baseline()
    psi = _train(system, stage, GPT_25M, batches, zero)
    return {**_growth(base), "psi": psi}


def test_training_peak_rss_below_ddp_by_what_is_sharded() -> None:
    ddp = run_distributed(train_worker, 2, "ddp", 0, timeout=900)
    psi = ddp[0]["psi"]
    ddp_peak = min(r["peak"] for r in ddp)
    report = [f"DDP {[round(r['peak'] / MiB) for r in ddp]} MiB"]
    failures = []
    # fp32 + Adam, N = 2: DDP holds 16Ψ bytes; stage 1 shards Adam's 8Ψ, stage 2 also half of the
    # 4Ψ gradients, stage 3 also half of the 4Ψ parameters.
    for stage, sharded, reshard in ((1, 4 * psi, False), (2, 6 * psi, False), (3, 8 * psi, False), (3, 8 * psi, True)):
        results = run_distributed(train_worker, 2, "zeroshard", stage, reshard, timeout=900)
        name = f"stage {stage}" + (" as FSDP2" if reshard else "")
        report.append(f"{name} {[round(r['peak'] / MiB) for r in results]} MiB (needs <= "
                      f"{(ddp_peak - 0.6 * sharded) / MiB:.0f})")
        for rank, r in enumerate(results):
            if r["peak"] > ddp_peak - 0.6 * sharded:
                failures.append(f"{name} rank {rank}")
    print("; ".join(report))
    assert not failures, f"{failures}: " + "; ".join(report)
