#!/usr/bin/env python3
"""What the communication logger (``comms_logger``, :mod:`zeroshard.monitor.comms`) costs per step.

Trains the demo GPT (``examples/gpt.py``, 6 layers × 256 wide, about 5M parameters) on 2 gloo
ranks at ZeRO stages 0-3 with 2 accumulation steps, alternating rounds with the logger installed
and uninstalled step by step in the same processes (the engine is built with
``comms_logger.enabled``; a step "off" takes it out of the collectives' hook, which then costs one
attribute check), and reports the median step time of each, their ratio, the collectives the
logger recorded per step and the logger's own bookkeeping time. The logger makes each collective
blocking (it waits for it to time it), so overlap is lost while on.

    python benchmarks/studies/comms_logger_cost.py [--pairs 10]

Writes ``benchmarks/results/comms_logger_cost.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness.spawned import demo_gpt_step, run_on_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "comms_logger_cost.md"


def bookkeeping_seconds(calls: int = 20000) -> float:
    """The logger's own time per collective: :meth:`CommsLogger.run` around a launch that does nothing."""
    from zeroshard.config import load_config
    from zeroshard.monitor.comms import CommsLogger

    log = CommsLogger(load_config({"train_micro_batch_size_per_gpu": 1}, 1).comms_logger, 1, 2)
    cpu = torch.device("cpu")
    t = time.perf_counter()
    for _ in range(calls):
        log.run("all_reduce", 4096, cpu, lambda: None)
    return (time.perf_counter() - t) / calls


def worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, GPTConfig

    import zeroshard

    rows = []
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=6, n_embd=256, block_size=64))
        cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
               "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
               "comms_logger": {"enabled": True}}
        engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        log = engine.comms_logger
        demo_gpt_step(engine)  # warm-up
        log.summary(print_log=False, reset=True)
        times: dict[bool, list[float]] = {True: [], False: []}
        # Steps on and off alternate (on-off, then off-on) so that load from other processes,
        # which comes in bursts, falls on both alike.
        for pair in range(args.pairs):
            for on in ((True, False) if pair % 2 == 0 else (False, True)):
                log.install() if on else log.uninstall()
                times[on].append(demo_gpt_step(engine))
        log.uninstall()
        summary = log.summary(print_log=False)["summary"]
        calls = sum(e["count"] for sizes in summary.values() for e in sizes.values()) / args.pairs
        comm_ms = sum(e["total_latency_ms"] for sizes in summary.values() for e in sizes.values()) / args.pairs
        rows.append((stage, statistics.median(times[True]), statistics.median(times[False]), calls, comm_ms))
    return {"rows": rows, "bookkeeping": bookkeeping_seconds()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=10, help="steps with the logger on, and as many off")
    ap.add_argument("--note", default="", help="a sentence on the conditions, added to the results")
    args = ap.parse_args()
    data = run_on_ranks(worker, 2, args)
    book = data["bookkeeping"]
    lines = ["| stage | collectives logged per step | their latency per step (ms) | logger's own time per step (ms) "
             "| step, logger on (ms) | step, logger off (ms) | on / off |", "|---|---|---|---|---|---|---|"]
    for stage, on, off, calls, comm in data["rows"]:
        lines.append(f"| {stage} | {calls:.0f} | {comm:.1f} | {1e3 * calls * book:.3f} | {1e3 * on:.1f} | "
                     f"{1e3 * off:.1f} | {on / off:.3f} |")
    text = ("# Cost of the communication logger\n\n"
            f"`python benchmarks/studies/comms_logger_cost.py --pairs {args.pairs}`: demo GPT (6 × 256, "
            "~5M parameters), 2 gloo ranks on CPU, micro batch 4 × 64 tokens, 2 accumulation steps; median of "
            f"{args.pairs} steps with the logger on and {args.pairs} off, alternating in the same processes. On, "
            "every collective is waited for and timed, so it no longer overlaps with computation; the logger's "
            f"own bookkeeping is {1e6 * book:.1f} µs per collective (measured around a collective that does "
            "nothing), the column \"logger's own time\".\n\n" + "\n".join(lines) + "\n"
            + (f"\n{args.note}\n" if args.note else ""))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
