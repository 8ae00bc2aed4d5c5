#!/usr/bin/env python3
"""What the cross-rank agreement checks (``zeroshard.core.comm.agreement``) cost per optimizer step.

Trains the demo GPT (``examples/gpt.py``, 6 layers × 256 wide, about 5M parameters) on 2 gloo
ranks at ZeRO stages 1, 2 and 3 with 2 accumulation steps, alternating rounds with the checks on
and off (the per-micro-step check replaced by a no-op, and at stage 3 the gather guard detached
from the units) in the same processes, and reports the median step time of each, their ratio,
and one check's own time (a loop of the check's all-gather alone).

    python benchmarks/studies/agreement_cost.py [--steps 10 --rounds 4]

Writes ``benchmarks/results/agreement_cost.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness.spawned import demo_gpt_step, run_on_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "agreement_cost.md"


def worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, GPTConfig

    import zeroshard
    from zeroshard.core.comm import agreement

    os.environ["ZEROSHARD_VERIFY_GATHERS"] = "1"  # guard every gather (the default guards the first 2 steps)
    real_check = agreement.check
    rows = []
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=6, n_embd=256, block_size=64))
        cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
               "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
        engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        times: dict[bool, list[float]] = {True: [], False: []}
        co = getattr(engine.optimizer, "coordinator", None)
        verify = {u: u.verify for u in co.units} if co is not None else {}
        for r in range(2 * args.rounds):
            on = r % 2 == 0
            agreement.check = real_check if on else (lambda *a, **k: None)
            for u, v in verify.items():
                u.verify = v if on else None
            for step in range(args.steps + 1):
                seconds = demo_gpt_step(engine)
                if step:  # the first step of a round warms up
                    times[on].append(seconds)
        agreement.check = real_check
        gathers = co.gather_count + co.prefetch_count if co is not None and verify else 0
        per_step = gathers / max(1, 2 * args.rounds * (args.steps + 1))
        rows.append((stage, statistics.median(times[True]), statistics.median(times[False]),
                     per_step if any(verify.values()) else 0.0))
    values = [0, 1, 2, 3, 4]
    dist.barrier()
    t = time.perf_counter()
    for _ in range(200):
        agreement.check(values, None, "benchmark")
    alone = (time.perf_counter() - t) / 200
    return {"rows": rows, "alone": alone}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    data = run_on_ranks(worker, 2, args)
    lines = ["| stage | backward checks per step | guarded gathers per step (about) | step, checks on (ms) | "
             "step, checks off (ms) | on / off |", "|---|---|---|---|---|---|"]
    for stage, on, off, guarded in data["rows"]:
        checks = 2 if stage >= 2 else 1
        lines.append(f"| {stage} | {checks} | {guarded:.0f} | {1e3 * on:.1f} | {1e3 * off:.1f} | {on / off:.3f} |")
    text = ("# Cost of the cross-rank agreement check\n\n"
            f"`python benchmarks/studies/agreement_cost.py --steps {args.steps} --rounds {args.rounds}`: demo GPT "
            "(6 × 256, ~5M parameters), 2 gloo ranks on CPU, micro batch 4 × 64 tokens, 2 accumulation steps; "
            f"median step over {args.rounds} alternating rounds each. One check alone (one all-gather of eight "
            f"int64 per rank): {1e6 * data['alone']:.0f} µs. At stage 3 the gather guard adds one such "
            "all-gather before each unit gather (here at every step, `ZEROSHARD_VERIFY_GATHERS=1`; by default only "
            "in the first two optimizer steps).\n\n"
            + "\n".join(lines) + "\n")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
