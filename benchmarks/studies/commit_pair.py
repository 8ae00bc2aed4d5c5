"""Before/after a change: zeroshard at two commits, timed in alternation on the same workload.

    python benchmarks/studies/commit_pair.py --before 9331ea3 --after HEAD [--rounds 3] [--stages 0,1,2,3]

Each commit is checked out into a temporary git worktree; every round runs one benchmark job per
stage and commit (``benchmarks/run.py --systems zeroshard``, fresh processes, the harness of this
checkout) with ``ZEROSHARD_BENCH_SRC`` pointing the launcher at that commit's ``src``, alternating which commit goes
first, so that both see the same machine load. Reported per stage: the median over rounds of each
job's median step time, and the after/before ratio of the medians (with the per-round ratios'
range). The workload defaults to the redesign issue's: the 25M GPT, 2 ranks, fp32, micro batch
2 × 128 tokens, 2 accumulation steps. Results: ``benchmarks/results/commit_pair.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "commit_pair.md"


def _worktree(ref: str, into: Path) -> tuple[Path, str]:
    sha = subprocess.run(["git", "rev-parse", "--short", ref], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    path = into / sha
    subprocess.run(["git", "worktree", "add", "--detach", "-f", str(path), sha], cwd=ROOT, check=True,
                   capture_output=True)
    return path, sha


def _job(tree: Path, stage: int, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--systems", "zeroshard", "--stages", str(stage),
           "--sizes", args.size, "--no-paired", "--micro-batch", str(args.micro_batch), "--seq-len",
           str(args.seq_len), "--grad-accum", str(args.grad_accum), "--warmup", str(args.warmup), "--steps",
           str(args.steps), "--out", str(out), "--markdown", str(out / "RESULTS.md")]
    env = {**os.environ, "ZEROSHARD_BENCH_SRC": str(tree / "src")}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    found = next(out.rglob("*.json"))
    result = json.loads(found.read_text())["results"][0]
    if result["status"] != "ok":
        raise RuntimeError(f"stage {stage} at {tree}: {result['status']}")
    if not str(result.get("zeroshard_from", "")).startswith(str(tree)):
        raise RuntimeError(f"the job imported zeroshard from {result.get('zeroshard_from')}, not {tree}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default="HEAD")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", default="25m")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        trees = [_worktree(args.before, Path(tmp)), _worktree(args.after, Path(tmp))]
        try:
            steps: dict[tuple[str, int], list[float]] = {}
            ratios: dict[int, list[float]] = {s: [] for s in stages}
            started = time.time()
            for r in range(args.rounds):
                for stage in stages:
                    order = trees if (r + stage) % 2 == 0 else trees[::-1]
                    got = {}
                    for tree, sha in order:
                        res = _job(tree, stage, args, Path(tmp) / f"out-{sha}-{stage}-{r}")
                        got[sha] = res["step_s"]
                        steps.setdefault((sha, stage), []).append(res["step_s"])
                    ratios[stage].append(got[trees[1][1]] / got[trees[0][1]])
                    print(f"round {r + 1}/{args.rounds} stage {stage}: " +
                          ", ".join(f"{sha} {t * 1e3:.1f} ms" for sha, t in got.items()), flush=True)
        finally:
            for tree, _ in trees:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    b, a = trees[0][1], trees[1][1]
    lines = [f"# zeroshard before/after: {b} → {a}", "",
             f"`{' '.join(['python', 'benchmarks/studies/commit_pair.py', *sys.argv[1:]])}`, "
             f"{time.strftime('%Y-%m-%d')}, {args.rounds} rounds alternating the order, {args.size} GPT, 2 CPU ranks "
             f"(gloo), fp32, micro batch {args.micro_batch} × {args.seq_len} tokens × {args.grad_accum} accumulation "
             f"steps, {args.warmup} warm-up + {args.steps} measured steps per job; {time.time() - started:.0f} s.", "",
             f"| stage | {b} step (ms) | {a} step (ms) | {a} / {b} | per-round ratios |", "|---|---|---|---|---|"]
    for stage in stages:
        mb, ma = statistics.median(steps[(b, stage)]), statistics.median(steps[(a, stage)])
        rr = ", ".join(f"{x:.3f}" for x in ratios[stage])
        lines.append(f"| {stage} | {mb * 1e3:.1f} | {ma * 1e3:.1f} | {ma / mb:.3f} | {rr} |")
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
