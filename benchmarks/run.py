"""Benchmark zeroshard against DeepSpeed, DDP, ZeroRedundancyOptimizer and FSDP2, side by side.

    python benchmarks/run.py --quick      # 25M model, a few steps, under 5 minutes on 2 CPU cores
    python benchmarks/run.py              # 25M and 120M models, paired timing (about 25 minutes)
    bash benchmarks/gpu.sh                # one GPU machine (runs this with --device cuda)

Every (system, stage, size) runs as a fresh multi-rank job (so import time, initialize time and
peak RSS are honest), trains the same GPT on the same batches from the same seed, and reports step
time, tokens/s, memory, start-up costs and the final loss. With ``--paired`` (the default without
``--quick``), step times come from paired jobs in which the systems of one stage take turns step by
step, so that they all see the same machine load. Results go to ``benchmarks/results/<device>.json``,
``benchmarks/results/chart[-cuda].png`` and ``benchmarks/RESULTS.md`` (CPU) or
``<out>/RESULTS-cuda.md``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/run.py`: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.launch import REPO, run_job
from benchmarks.harness.machine import describe
from benchmarks.harness.plan import attach_paired, placeholder, plan
from benchmarks.harness.report import write_reports
from benchmarks.harness.spec import SIZES, SYSTEM_LABELS, SYSTEMS, Job


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="25M only, few steps, no paired jobs (under 5 minutes)")
    p.add_argument("--sizes", help=f"comma-separated sizes from {sorted(SIZES)} (default 25m,120m; quick: 25m)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated systems (default: all)")
    p.add_argument("--stages", default="0,1,2,3", help="ZeRO stages for zeroshard and DeepSpeed")
    p.add_argument("--offload", action="store_true",
                   help="also run the 2+offload and 3+offload variants, and (CPU) benchmarks/studies/offload.py")
    p.add_argument("--paired", action=argparse.BooleanOptionalAction, default=None,
                   help="time the systems of each stage side by side (default: on, off with --quick)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--world-size", type=int, help="ranks per job (default: 2 on CPU, 1 on CUDA)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--micro-batch", type=int, help="sequences per rank per micro-step (default 4; CUDA 8)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default 64; CUDA 1024)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--warmup", type=int, help="untimed steps (default per size)")
    p.add_argument("--steps", type=int, help="measured steps (default per size)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every job this many times, alternating the order, and pool the step times")
    p.add_argument("--timeout", type=float, default=900.0, help="hard limit per job, seconds")
    p.add_argument("--deadline", type=float, help="seconds after which no new job starts (the rest are "
                                                  "reported as skipped); the report is still written")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="results directory")
    p.add_argument("--logs", type=Path, help="per-job worker logs and raw results (default benchmarks/out/<device>)")
    p.add_argument("--markdown", type=Path, help="results table (default: benchmarks/RESULTS.md on CPU, "
                                                 "<out>/RESULTS-cuda.md on CUDA)")
    args = p.parse_args(argv)
    if args.paired is None:
        args.paired = not args.quick
    return args


def _pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge repeats of one job: step times pooled, the rest from the median-time repeat."""
    ok = [r for r in runs if r["status"] == "ok" and "step_s" in r]
    if len(ok) < 2:
        return ok[0] if ok else runs[0]
    times = [t for r in ok for t in r["step_s_measured"]]
    best = sorted(ok, key=lambda r: r["step_s"])[len(ok) // 2]
    med = statistics.median(times)
    return {**best, "step_s": med, "step_s_pooled": times, "tokens_per_s": best["tokens_per_step"] / med,
            "repeats": len(ok)}


class Runner:
    """Runs jobs in order with the deadline, prints progress, keeps a partial JSON up to date."""

    def __init__(self, args: argparse.Namespace, total: int) -> None:
        self.args = args
        self.total = total
        self.n = 0
        self.start = time.monotonic()
        self.work = args.logs or REPO / "benchmarks" / "out" / args.device
        args.out.mkdir(parents=True, exist_ok=True)
        self.partial = args.out / f"{args.device}.partial.json"
        self.done: dict[str, list[dict[str, Any]]] = {}

    def __call__(self, job: Job) -> dict[str, Any]:
        self.n += 1
        who = "paired: " + ", ".join(f"{SYSTEM_LABELS[s]} {st}" for s, st in job.members) if job.members \
            else f"{SYSTEM_LABELS[job.system]} stage {job.variant}"
        print(f"[{self.n}/{self.total}] {job.size} {who} ...", end=" ", flush=True)
        if self.args.deadline is not None and time.monotonic() - self.start > self.args.deadline:
            r = placeholder(job, "skipped", f"not started: the {self.args.deadline:.0f} s deadline had passed")
        else:
            r = run_job(job, self.work, self.args.timeout)
        self.done.setdefault(job.key, []).append(r)
        print(_summary(r), flush=True)
        self.partial.write_text(json.dumps(self.done, default=str))  # survives a kill of this process
        return r


def main(argv: list[str] | None = None) -> int:
    """Plan, run every job with a hard deadline, write the reports. Exit 1 if a zeroshard or paired job
    failed (a peer that fails, DeepSpeed on CPU say, is recorded with its reason and the run goes on)."""
    args = parse_args(argv)
    machine = describe()  # before the run: the tree being measured
    jobs, paired_jobs, missing = plan(args)
    for m in missing:
        print(f"MISSING {m['system']}: {m['reason']}", flush=True)
    run = Runner(args, len(jobs) * args.repeat + len(paired_jobs))
    for rep in range(args.repeat):
        for job in jobs if rep % 2 == 0 else list(reversed(jobs)):
            run(job)
    paired = [run(job) for job in paired_jobs]
    results = [_pool(run.done[j.key]) for j in jobs] + missing
    attach_paired(results, paired)
    command = "python benchmarks/run.py" + ("" if not sys.argv[1:] else " " + shlex.join(sys.argv[1:]))
    meta = {**machine, "command": command, "elapsed_s": round(time.monotonic() - run.start, 1),
            "device": args.device, "paired": [{k: v for k, v in p.items() if k != "job"} for p in paired]}
    for p in write_reports(results, meta, args.out, args.markdown):
        print(f"wrote {p}")
    run.partial.unlink(missing_ok=True)
    fatal = args.offload and args.device == "cpu" and not _offload_section(args)
    for r in results + paired:
        if r["status"] != "failed":
            continue
        is_paired = bool(r.get("job", {}).get("members"))
        ours = is_paired or r["system"] == "zeroshard"
        fatal = fatal or ours
        who = "PAIRED JOB FAILED" if is_paired else "FAILED" if ours else "PEER FAILED (recorded, not an error)"
        print(f"{who} {r['key']}: {r.get('reason')} (logs: {r.get('logs')})", file=sys.stderr)
    return 1 if fatal else 0


def _offload_section(args: argparse.Namespace) -> bool:
    """``--offload`` on CPU: run ``benchmarks/studies/offload.py`` (zeroshard and DeepSpeed, CPU and NVMe offload,
    I/O bounds, parity), write ``<out>/offload.md`` and append it to the markdown report. (``report.py``
    re-renders the report without it.) False when a zeroshard offload run failed."""
    from benchmarks.harness.report import default_markdown
    from benchmarks.studies.offload import main as offload_main

    out = args.out / "offload.md"
    ok = offload_main(["--out", str(out)]) == 0
    md = args.markdown or default_markdown(args.device, args.out)
    section = out.read_text().replace("\n## ", "\n### ").replace("# ", "## ", 1)
    md.write_text(md.read_text() + "\n" + section)
    print(f"appended {out} to {md}")
    return ok


def _summary(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return f"{r['status'].upper()}: {r.get('reason', '')[:160]} ({r.get('wall_s', 0):.0f}s)"
    if "members" in r:
        parts = [f"{n} {m['step_s']:.3f}s" if m["status"] == "ok" else f"{n} {m['status']}"
                 for n, m in r["members"].items()]
        return ", ".join(parts) + f" ({r['wall_s']:.0f}s)"
    return (f"{r['step_s']:.3f} s/step, {r['tokens_per_s']:.0f} tok/s, loss {r['final_loss']:.4f}, "
            f"init {r['initialize_s']:.2f}s ({r['wall_s']:.0f}s)")


if __name__ == "__main__":
    sys.exit(main())
