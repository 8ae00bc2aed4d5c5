"""Profile one system's training step with torch.profiler, on every rank, and print rank 0's top ops.

    python benchmarks/studies/profile_step.py --system zeroshard --stage 1 [--size 25m] [--steps 4] [--grad-accum 2]

Runs one benchmark job (same workload as ``run.py``) with ``BENCH_PROFILE`` set; tables and Chrome
traces land in ``benchmarks/out/profile/<job>/`` (open the traces in https://ui.perfetto.dev).
Also prints the per-phase medians (forward, backward, optimizer) that the job measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.harness.launch import REPO, run_job
from benchmarks.harness.spec import FIXED_STAGE, SIZES, SYSTEMS, Job, Workload


def main(argv: list[str] | None = None) -> int:
    """Run the profiled job and print the result."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system", choices=SYSTEMS, required=True)
    p.add_argument("--stage", type=int, help="ZeRO stage (zeroshard, deepspeed)")
    p.add_argument("--size", choices=sorted(SIZES), default="25m")
    p.add_argument("--steps", type=int, default=4, help="profiled steps after 2 warm-up steps")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--grad-accum", type=int, default=1)
    args = p.parse_args(argv)
    stage = FIXED_STAGE.get(args.system, args.stage if args.stage is not None else 0)
    wl = Workload(micro_batch=args.micro_batch, seq_len=args.seq_len, grad_accum=args.grad_accum,
                  warmup_steps=2, measure_steps=args.steps)
    job = Job(args.system, stage, args.size, workload=wl)
    out = REPO / "benchmarks" / "out" / "profile" / job.key
    r = run_job(job, REPO / "benchmarks" / "out" / "profile-runs", 900, extra_env={"BENCH_PROFILE": str(out)})
    if r["status"] != "ok":
        print(f"{r['status']}: {r.get('reason')} (logs: {r.get('logs')})", file=sys.stderr)
        return 1
    print(f"{job.key}: median step {r['step_s']:.3f} s (profiled, so slower than in run.py)")
    print("phases (median s):", {k: round(v, 3) for k, v in r.get("phases_s", {}).items()})
    print((out / "rank0.txt").read_text())
    print(f"traces: {out}/rank*.trace.json; initialize (cProfile): {out}/rank0-initialize.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
