#!/usr/bin/env python3
"""What the progress report, ``wall_clock_breakdown`` and the CSV + TensorBoard monitors cost per step.

Trains the demo GPT (``examples/gpt.py``, 6 layers × 256 wide, about 5M parameters) on 2 gloo
ranks at ZeRO stages 2 and 3 with 2 accumulation steps. In the same processes, two engines on
the same model: one with ``steps_per_print: 10``, ``wall_clock_breakdown``, and the ``csv_monitor``
and ``tensorboard`` monitors (writing under a temporary directory), one with none of them.
Rounds alternate between the two, and the report gives the median step time of each, their
ratio, and the time spent in the engine's reporter itself (``engine.reporter.step_done``:
recording, and every 10 steps the all-reduce of the losses, the log line and the monitor writes
and flushes), timed around the call on rank 0.

    python benchmarks/studies/monitor_cost.py [--steps 20 --rounds 4]

Writes ``benchmarks/results/monitor_cost.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness.spawned import demo_gpt_step, run_on_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "monitor_cost.md"


def _config(stage: int, on: bool, out: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    if on:
        cfg.update(steps_per_print=10, wall_clock_breakdown=True,
                   csv_monitor={"enabled": True, "output_path": out, "job_name": f"csv{stage}"},
                   tensorboard={"enabled": True, "output_path": out, "job_name": f"tb{stage}"})
    return cfg


def _timed_reporter(engine: Any, spent: list[float]) -> None:
    """Time every ``step_done`` call of ``engine``'s reporter into ``spent`` (benchmark only)."""
    inner = engine.reporter.step_done

    def step_done(*args: Any, **kwargs: Any) -> None:
        t = time.perf_counter()
        inner(*args, **kwargs)
        spent.append(time.perf_counter() - t)

    engine.reporter.step_done = step_done


def worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, GPTConfig

    import zeroshard

    rows = []
    out = args.out  # one directory for all ranks: the config must be the same everywhere
    for stage in (2, 3):
        engines = {}
        spent: list[float] = []
        for on in (True, False):
            torch.manual_seed(0)
            model = GPT(GPTConfig(n_layer=6, n_embd=256, block_size=64))
            engines[on], *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                                   config=_config(stage, on, out))
        _timed_reporter(engines[True], spent)
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(2 * args.rounds):
            on = r % 2 == 0
            engine = engines[on]
            for step in range(args.steps + 1):
                seconds = demo_gpt_step(engine)
                if step:  # the first step of a round warms up
                    times[on].append(seconds)
        engines[True].monitor.close()
        rows.append({"stage": stage, "on": statistics.median(times[True]), "off": statistics.median(times[False]),
                     "reporter": sum(spent) / max(len(spent), 1), "reporter_max": max(spent, default=0.0)})
    return {"rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round (a multiple of 10 is fair)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per setting, alternating")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        args.out = out
        data = run_on_ranks(worker, 2, args)
    lines = ["| stage | step, all on (ms) | step, all off (ms) | on / off | reporter per step, mean (ms) | "
             "reporter / step | reporter, slowest call (ms) |", "|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        lines.append(f"| {row['stage']} | {1e3 * row['on']:.1f} | {1e3 * row['off']:.1f} "
                     f"| {row['on'] / row['off']:.3f} | {1e3 * row['reporter']:.3f} "
                     f"| {100 * row['reporter'] / row['off']:.2f}% "
                     f"| {1e3 * row['reporter_max']:.2f} |")
    text = ("# Cost of the progress report, wall_clock_breakdown and the CSV + TensorBoard monitors\n\n"
            f"`python benchmarks/studies/monitor_cost.py --steps {args.steps} --rounds {args.rounds}`: demo GPT "
            "(6 × 256, ~5M parameters), 2 gloo ranks on CPU, micro batch 4 × 64 tokens, 2 accumulation steps; "
            f"median step over {args.rounds} alternating rounds each. \"All on\": `steps_per_print: 10`, "
            "`wall_clock_breakdown: true`, `csv_monitor` and `tensorboard` enabled. \"Reporter\": time inside "
            "`engine.reporter.step_done` on rank 0, averaged over all steps (every 10th step holds the all-reduce, "
            "the log line, the monitor writes and flushes; the slowest call is one of those).\n\n"
            + "\n".join(lines) + "\n")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
