#!/usr/bin/env python3
"""Lost-node trials on the emulated two-node cluster (``tests/emulated_cluster.py``; needs root).

Each trial runs ``tests/cluster_fault_train.py`` with torchrun on two nodes (1 or 2 ranks each) at a
ZeRO stage, with the default ``collective_timeout`` (10 minutes), and SIGKILLs every process of
node 1 at a moment of a step: as its ranks enter ``forward``, ``backward``, the optimizer ``step`` or
``save`` (``save_checkpoint``), plus a random 0-``--jitter`` s, so that the kill lands inside the
call with its transfers in flight; or inside ``agreement`` (the backward's agreement check, where
node 1 waits to be killed, node 0 in the check's all-gather). It measures the time from the kill to
node 0's torchrun ending, and checks that node 0's output names the lost ranks
(``lost peers: ranks 2, 3 (all of node 1)``).

    sudo python3 scripts/cluster_fault_trials.py --trials 24 [--seed 0] [--bound 10] [--md FILE]

Prints one line per trial, the slowest, and with ``--md`` writes the table as Markdown; exits
non-zero when a trial took longer than ``--bound`` s or did not name the lost ranks.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from emulated_cluster import EmulatedCluster, available, start_torchrun  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "cluster_fault_train.py"
MOMENTS = ("forward", "backward", "step", "save", "agreement")
STAGES = (0, 1, 2, 3)
STEPS, SAVE_EVERY = 12, 3
START_S, LIMIT_S = 240.0, 120.0  # to reach the kill; from the kill to giving up on node 0


@dataclass
class Trial:
    stage: int
    nproc: int
    moment: str
    step: int
    jitter: float


@dataclass
class Result:
    trial: Trial
    seconds: float | None  # kill to node 0's torchrun exit (None: still running at LIMIT_S)
    named: bool
    line: str  # node 0's line naming the lost peers
    node0_code: int | None
    how: str = ""  # how node 0's first error came (how_it_ended)
    note: str = ""


def how_it_ended(text: str) -> str:
    """From node 0's output: ``verdict`` (a wait raised the watchdog's verdict), ``gloo error``
    (gloo raised first; the verdict named the peers), ``exited by the watchdog`` (a rank blocked
    where no slice reaches), or ``heartbeats`` (named by the heartbeats alone, without a verdict)."""
    if "was blocked" in text and "after the verdict" in text:
        return "exited by the watchdog"
    first = next((ln for ln in text.splitlines() if "failed in" in ln and ln.lstrip().startswith(("rank", "["))), "")
    if "a peer's process is gone (found by" in first:
        return "verdict"
    if "stopped or dead: its process is gone" in text:
        return "gloo error"
    return "heartbeats"


def plan(n: int, seed: int, jitter: float) -> list[Trial]:
    """``n`` trials spread over stage x ranks per node x moment (every combination once before any
    twice), in a seeded order, each at a seeded step."""
    rng = random.Random(seed)
    combos = list(itertools.product(STAGES, (1, 2), MOMENTS))
    rng.shuffle(combos)
    trials = []
    for stage, nproc, moment in itertools.islice(itertools.cycle(combos), n):
        step = rng.choice([3, 6, 9]) if moment == "save" else rng.randrange(3, STEPS - 1)
        trials.append(Trial(stage, nproc, moment, step, 0.0 if moment == "agreement" else rng.uniform(0, jitter)))
    return trials


def expected(nproc: int) -> str:
    lost = [nproc + i for i in range(nproc)]
    return f"lost peers: rank{'s' if nproc > 1 else ''} {', '.join(map(str, lost))} (all of node 1)"


def run_trial(cluster: EmulatedCluster, t: Trial, workdir: Path, layers: int, hidden: int) -> Result:
    out = Path(tempfile.mkdtemp(prefix="trial-", dir=workdir))
    batch = 8 * 2 * t.nproc
    args = ["--out", str(out), "--ckpt", str(out / "ckpt"), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
            "--stage", str(t.stage), "--batch", str(batch), "--timeout", "0", "--layers", str(layers),
            "--hidden", str(hidden), "--kill-at", f"{t.moment}:{t.step}"]
    job = start_torchrun(cluster, SCRIPT, args, nproc_per_node=t.nproc)
    deadline = job.started + START_S
    while not list(out.glob("at.rank*")):
        if time.monotonic() > deadline or any(p.poll() is not None for p in job.procs):
            run = job.wait(0)
            return Result(t, None, False, "", run.nodes[0].returncode,
                          "did not reach the moment:\n" + run.describe()[-3000:])
        time.sleep(0.005)
    time.sleep(t.jitter)
    killed = time.monotonic()
    cluster.kill_node(1)
    while job.procs[0].poll() is None and time.monotonic() < killed + LIMIT_S:
        time.sleep(0.02)
    seconds = time.monotonic() - killed if job.procs[0].poll() is not None else None
    run = job.wait(0)
    text = run.nodes[0].stderr + run.nodes[0].stdout
    want = expected(t.nproc)
    line = next((ln.strip() for ln in text.splitlines() if "lost peers:" in ln), "")
    note = "" if want in text else "node 0's output:\n" + text[-3000:]
    return Result(t, seconds, want in text, line, run.nodes[0].returncode, how_it_ended(text), note)


def markdown(results: list[Result], bound: float, args: argparse.Namespace) -> str:
    rows = ["| # | stage | ranks per node | moment of the kill (step) | node 0 ended after (s) | lost ranks named "
            "| node 0's first error |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for i, r in enumerate(results):
        t = r.trial
        when = f"{t.moment} ({t.step})" + (f" + {t.jitter:.2f} s" if t.jitter else "")
        took = f"{r.seconds:.1f}" if r.seconds is not None else f"> {LIMIT_S:.0f} (still running)"
        rows.append(f"| {i} | {t.stage} | {t.nproc} | {when} | {took} | {'yes' if r.named else 'NO'} | {r.how} |")
    done = [r.seconds for r in results if r.seconds is not None]
    slowest = max(done) if done else float("nan")
    ok = sum(1 for r in results if r.seconds is not None and r.seconds <= bound and r.named)
    return "\n".join(rows) + (f"\n\n{len(results)} trials, {ok} ended within {bound:.0f} s naming the lost ranks; "
                              f"slowest {slowest:.1f} s.\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--first", type=int, default=0, help="skip the plan's first trials (to continue a run)")
    ap.add_argument("--bound", type=float, default=10.0, help="seconds node 0 may take to end after the kill")
    ap.add_argument("--jitter", type=float, default=0.3, help="at most this long after the moment is reached")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--md", type=Path, help="also write the table here (Markdown)")
    args = ap.parse_args()
    ok, why = available()
    if not ok:
        print(f"no emulated cluster here: {why}")
        return 2
    results = []
    with tempfile.TemporaryDirectory(prefix="zs-lost-node-") as tmp, \
            EmulatedCluster(rate="1gbit", prefix="zslost") as cluster:
        for i, t in enumerate(plan(args.trials, args.seed, args.jitter)):
            if i < args.first:
                continue
            r = run_trial(cluster, t, Path(tmp), args.layers, args.hidden)
            results.append(r)
            took = f"{r.seconds:5.1f} s" if r.seconds is not None else "still running"
            verdict = "ok" if r.seconds is not None and r.seconds <= args.bound and r.named else "FAIL"
            print(f"trial {i:2d}: stage {t.stage}, {t.nproc} rank(s) per node, killed at {t.moment} of step "
                  f"{t.step} + {t.jitter:.2f} s: node 0 ended after {took}, exit {r.node0_code} ({r.how}): {verdict}\n"
                  f"    {r.line}", flush=True)
            if r.note:
                print("    " + r.note.replace("\n", "\n    "), flush=True)
    table = markdown(results, args.bound, args)
    print(table)
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(table)
    bad = [r for r in results if r.seconds is None or r.seconds > args.bound or not r.named]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
