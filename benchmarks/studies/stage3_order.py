#!/usr/bin/env python3
"""What a module order that changes every step costs ZeRO-3, against a fixed order.

Same model, data and amount of compute in every variant; only the order in which the blocks run
changes (all ranks run the same order, as ZeRO-3 requires):

- ``fixed``: blocks 0..N-1 every step;
- ``permuted``: a new random permutation of the blocks every step;
- ``layer-drop``: a random quarter of the blocks skipped every step (the same count as
  ``fixed-drop``, which always skips the same blocks).

Each under the default live budget (everything stays gathered between forward and backward, so
order hardly matters) and a tight one (two blocks live and two prefetched, so prefetching must
follow the order). Reports the median step time, all-gathers per step (on demand and prefetched)
and the most parameters gathered at once, on 2 gloo ranks (CPU).

    python benchmarks/studies/stage3_order.py [--blocks 12 --width 256 --steps 12]

Writes ``benchmarks/results/stage3_order.md``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness.spawned import run_on_ranks  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "results" / "stage3_order.md"
WARMUP = 3


class Net(nn.Module):
    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(blocks))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, order: list[int]) -> torch.Tensor:
        h = self.embed(x)
        for i in order:
            h = h + self.blocks[i](h)
        return self.head(h)


def orders(variant: str, blocks: int, steps: int) -> list[list[int]]:
    r = random.Random(0)
    keep = blocks - blocks // 4
    out = []
    for _ in range(steps):
        if variant == "fixed":
            out.append(list(range(blocks)))
        elif variant == "permuted":
            out.append(r.sample(range(blocks), blocks))
        elif variant == "fixed-drop":
            out.append(list(range(keep)))
        else:  # layer-drop: a random subset of the same size, in order
            out.append(sorted(r.sample(range(blocks), keep)))
    return out


def worker(rank: int, world: int, args: argparse.Namespace) -> list:
    import zeroshard

    block = 8 * args.width * args.width + 5 * args.width
    budgets = {"default": {}, "tight": {"stage3_max_live_parameters": 2 * block,
                                        "stage3_prefetch_bucket_size": 2 * block,
                                        "stage3_param_persistence_threshold": 10 * args.width}}
    lines = []
    for budget, zero in budgets.items():
        for variant in ("fixed", "permuted", "fixed-drop", "layer-drop"):
            torch.manual_seed(0)
            model = Net(args.blocks, args.width)
            cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_clipping": 1.0,
                   "zero_optimization": {"stage": 3, **zero},
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
            engine, opt, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            co = opt.coordinator
            g = torch.Generator().manual_seed(rank)
            times, gathers, prefetches = [], [], []
            for step, order in enumerate(orders(variant, args.blocks, args.steps + WARMUP)):
                x = torch.randn(args.batch, args.width, generator=g)
                g0, p0 = co.gather_count, co.prefetch_count
                dist.barrier()
                t = time.perf_counter()
                loss = engine(x, order).square().mean()
                engine.backward(loss)
                engine.step()
                dist.barrier()
                if step >= WARMUP:
                    times.append(time.perf_counter() - t)
                    gathers.append(co.gather_count - g0)
                    prefetches.append(co.prefetch_count - p0)
            if rank == 0:
                lines.append((budget, variant, statistics.median(times), statistics.mean(gathers),
                              statistics.mean(prefetches), co.peak_gathered_numel))
            del engine, opt
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    lines = run_on_ranks(worker, 2, args)
    base = {(b, v): t for b, v, t, *_ in lines}
    n_params = sum(p.numel() for p in Net(args.blocks, args.width).parameters())
    rows = ["| budget | order | step (ms) | × its fixed order | all-gathers / step | of which prefetched "
            "| peak gathered (M params) |", "|---|---|---|---|---|---|---|"]
    for budget, variant, t, gathers, prefetches, peak in lines:
        ref = base[(budget, "fixed" if variant in ("fixed", "permuted") else "fixed-drop")]
        rows.append(f"| {budget} | {variant} | {1e3 * t:.1f} | {t / ref:.2f} | {gathers:.1f} | {prefetches:.1f} "
                    f"| {peak / 1e6:.2f} |")
    text = (f"# ZeRO-3: changing module order vs fixed\n\n`python benchmarks/studies/stage3_order.py "
            f"--blocks {args.blocks} --width {args.width} --batch {args.batch} --steps {args.steps}`: "
            f"{n_params / 1e6:.1f}M parameters, "
            f"2 gloo ranks on CPU, fp32, torch {torch.__version__}; median of {args.steps} steps after "
            f"{WARMUP} warm-up.\n\n" + "\n".join(rows) + "\n")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
