#!/usr/bin/env python3
"""Seeded fault-injection trials on a 2-rank job (CI runs three: tests/distributed/test_faults.py).

Each trial SIGKILLs or SIGSTOPs a random rank at a random point (forward, backward, optimizer
step, checkpoint save) of a random step, without restarts or with ``--max_restarts 1`` and
``checkpoint.auto_resume``; see ``tests/faults.py`` for what each must show.

    python scripts/fault_trials.py --trials 20 [--seed 0]

Prints one line per trial and the counts; exits non-zero when any trial misbehaved.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from faults import Fault, check, run_trial  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    bad = 0
    kinds: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="zeroshard-faults-") as tmp:
        ref = run_trial(Path(tmp), None)
        if ref.code != 0 or ref.params is None:
            print(ref.stderr[-3000:])
            return 1
        for i in range(args.trials):
            fault = Fault.draw(args.seed + i)
            restarts = (args.seed + i) % 2
            t = time.monotonic()
            outcome = run_trial(Path(tmp), fault, restarts)
            problems = check(outcome, fault, restarts, ref.params)
            verdict = "ok" if not problems else "FAIL"
            key = f"{fault.kind}/{'restart' if restarts else 'no restart'}"
            kinds[key] = kinds.get(key, 0) + 1
            print(f"trial {i:2d} seed {args.seed + i}: {fault.env():22s} restarts {restarts}: exit {outcome.code:3d} "
                  f"in {time.monotonic() - t:5.1f} s: {verdict}", flush=True)
            for p in problems:
                print("    " + p.replace("\n", "\n    "))
            bad += bool(problems)
    print(f"{args.trials} trials ({', '.join(f'{k}: {v}' for k, v in sorted(kinds.items()))}), {bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
