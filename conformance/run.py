"""Run DeepSpeed's own ZeRO unit tests against the real DeepSpeed and against zeroshard, side by side.

DeepSpeed's tests, untouched, are the strictest check of a drop-in: this runner copies ``tests/`` out
of a DeepSpeed checkout (so that the checkout's uncompiled ``deepspeed/`` sources never shadow the
installed package), runs the chosen files with pytest once per side, and prints, per file, how many
tests pass on each. On the zeroshard side every process, the ones DeepSpeed's harness spawns
included, starts with :func:`zeroshard.deepspeed.imports.enable` (a ``sitecustomize`` on
``PYTHONPATH``), so ``import deepspeed`` resolves to zeroshard as it would in a user's script run
under ``python -m zeroshard.deepspeed.imports``.

Tests that pass on DeepSpeed and not on zeroshard are listed, each with its reason from
``expected_differences.toml`` beside this file, or marked UNEXPECTED (the exit status is then 1).

Not run by CI: CI cannot fetch DeepSpeed's repository. Usage::

    git clone https://github.com/deepspeedai/DeepSpeed /tmp/DeepSpeed
    python conformance/run.py /tmp/DeepSpeed                 # both sides, the default files
    python conformance/run.py /tmp/DeepSpeed --side zeroshard --files tests/unit/runtime/zero/test_zero_config.py
    python conformance/run.py /tmp/DeepSpeed --side compare   # the table again, from the kept outcomes

The real side needs ``pip install deepspeed==0.19.8``; both run on CPU with gloo
(``DS_ACCELERATOR=cpu``, ``LOCAL_SIZE=4`` so that the multi-rank tests are not skipped).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
#: The files of DeepSpeed's ZeRO tests, relative to the checkout (globs).
DEFAULT_FILES = (
    "tests/unit/v1/zero/test_zero.py",
    "tests/unit/runtime/zero/test_*.py",
    "tests/unit/checkpoint/test_*.py",
    "tests/unit/runtime/half_precision/test_zero_optim_overflow.py",
    "tests/unit/runtime/activation_checkpointing/test_*.py",
)
#: The subset the conformance goal is measured on (at least 90% of what passes on DeepSpeed).
GOAL_FILES = (
    "tests/unit/runtime/zero/test_*.py",
    "tests/unit/checkpoint/test_latest_checkpoint.py",
    "tests/unit/checkpoint/test_tag_validation.py",
    "tests/unit/runtime/half_precision/test_zero_optim_overflow.py",
)
#: a file's whole run is killed after this long (DeepSpeed's harness leaves some failures hanging)
FILE_TIMEOUT_S = 2400
_SITECUSTOMIZE = """\
import zeroshard.deepspeed.imports
zeroshard.deepspeed.imports.enable(shadow=True)
"""


def _expand(checkout: Path, patterns: list[str]) -> list[str]:
    files: list[str] = []
    for pattern in patterns:
        found = sorted(str(p.relative_to(checkout)) for p in checkout.glob(pattern))
        if not found:
            raise SystemExit(f"no file in {checkout} matches {pattern!r}")
        files += [f for f in found if f not in files]
    return files


_RESULT = re.compile(r"^(unit/\S+\.py::\S.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_log(text: str) -> dict[str, str]:
    """pytest's verbose lines (DeepSpeed's conftest turns verbose on) -> {test id: outcome}.

    A test that fails in its teardown after passing is reported twice; the last word counts.
    """
    outcomes: dict[str, str] = {}
    for line in _ANSI.sub("", text).splitlines():
        if (m := _RESULT.match(line)) is not None:
            outcomes["tests/" + m.group(1)] = m.group(2).lower()
    return outcomes


def _run_side(side: str, work: Path, files: list[str], out: Path, extra: list[str], timeout: int,
              rerun: bool, deselect: list[str]) -> dict[str, str]:
    """Run pytest once per file for one side; return every outcome recorded so far for those files.

    Outcomes accumulate in ``OUT/<side>.json`` file by file, so an interrupted run resumes where it
    stopped (``--rerun`` runs the files again); each file's output is kept in ``OUT/<side>/``.
    """
    env = dict(os.environ, DS_ACCELERATOR="cpu", LOCAL_SIZE="4", DS_UNITTEST_TIMEOUT=str(timeout))
    if side == "zeroshard":
        shim = out / "zeroshard_site"
        shim.mkdir(parents=True, exist_ok=True)
        (shim / "sitecustomize.py").write_text(_SITECUSTOMIZE)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), env.get("PYTHONPATH", "")) if p)
    store = out / f"{side}.json"
    results: dict[str, dict[str, str]] = json.loads(store.read_text()) if store.is_file() else {}
    (out / side).mkdir(parents=True, exist_ok=True)
    for file in files:
        if file in results and not rerun:
            continue
        started = time.monotonic()
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rN", file.removeprefix("tests/"), *extra]
        if side == "zeroshard":  # tests known to hang DeepSpeed's harness on zeroshard (see the toml)
            # pytest's --deselect takes node id prefixes, not globs: "Class::*" is given as "Class::"
            cmd += [f"--deselect={t.removeprefix('tests/').rstrip('*')}" for t in deselect if t.startswith(file + "::")]
        try:
            done = subprocess.run(cmd, cwd=work / "tests", env=env, capture_output=True, text=True, check=False,
                                  timeout=FILE_TIMEOUT_S)
            log, code = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as e:  # a hang the harness's own timeout did not end
            log, code = f"{e.stdout or ''}{e.stderr or ''}\n[conformance] killed after {FILE_TIMEOUT_S} s", -1
        (out / side / (file.replace("/", "_") + ".log")).write_text(log)
        results[file] = parse_log(log)
        if not results[file] and code not in (0, 5):  # nothing ran: it failed to import
            results[file] = {file + "::<collection>": "error"}
        store.write_text(json.dumps(results, indent=1, sort_keys=True))
        counts = Counter(results[file].values())
        print(f"[{side}] {file}: {dict(counts)} in {time.monotonic() - started:.0f} s", flush=True)
    return {t: o for f in files for t, o in results.get(f, {}).items()}


#: the kinds of difference ``expected_differences.toml`` may give: every test that passes on DeepSpeed and
#: not on zeroshard is settled, none is left open or for later
KINDS = ("internal", "format", "deliberate")


def load_expected(path: Path) -> list[tuple[str, str]]:
    """``expected_differences.toml`` -> [(test id glob, reason)]; an entry without a reason or of a kind
    other than :data:`KINDS` is an error."""
    data = tomllib.loads(path.read_text())
    for entry in data.get("difference", []):
        if entry.get("kind") not in KINDS or not entry.get("reason"):
            raise SystemExit(f"{path}: the entry for {entry.get('tests')} needs a reason and a kind in {KINDS}, "
                             f"not {entry.get('kind')!r}")
    return [(pattern, entry["reason"]) for entry in data.get("difference", [])
            for pattern in entry["tests"]]


def load_deselected(path: Path) -> list[str]:
    """The test ids ``expected_differences.toml`` marks ``deselect = true``: they hang the harness."""
    data = tomllib.loads(path.read_text())
    return [t for entry in data.get("difference", []) if entry.get("deselect") for t in entry["tests"]]


def _reason(test_id: str, expected: list[tuple[str, str]]) -> str | None:
    # a test id's own brackets ("test[1001]") would be a character class to fnmatch: equal ids match first
    return next((reason for pattern, reason in expected
                 if pattern == test_id or fnmatch.fnmatchcase(test_id, pattern)), None)


def summarize(real: dict[str, str], ours: dict[str, str], goal: list[str],
              expected: list[tuple[str, str]]) -> int:
    """Print the per-file table and the differences; return the number of unexplained ones.

    Only the files both sides ran are compared (a run interrupted on one side leaves the others out).
    """
    ran_both = {t.split("::")[0] for t in real} & {t.split("::")[0] for t in ours}
    real = {t: o for t, o in real.items() if t.split("::")[0] in ran_both}
    ours = {t: o for t, o in ours.items() if t.split("::")[0] in ran_both}
    per_file: dict[str, Counter[str]] = defaultdict(Counter)
    for test_id in sorted(set(real) | set(ours)):
        file = test_id.split("::")[0]
        per_file[file]["tests"] += 1
        per_file[file]["real"] += real.get(test_id) == "passed"
        per_file[file]["ours"] += ours.get(test_id) == "passed"
        per_file[file]["both"] += real.get(test_id) == "passed" and ours.get(test_id) == "passed"
    print(f"\n{'file':<70} {'tests':>5} {'DeepSpeed':>9} {'zeroshard':>9} {'both':>5}")
    for file, c in sorted(per_file.items()):
        print(f"{file:<70} {c['tests']:>5} {c['real']:>9} {c['ours']:>9} {c['both']:>5}")
    total = sum(per_file.values(), Counter())
    print(f"{'all':<70} {total['tests']:>5} {total['real']:>9} {total['ours']:>9} {total['both']:>5}")
    in_goal = [f for f in per_file if f in goal]
    goal_real = sum(per_file[f]["real"] for f in in_goal)
    goal_both = sum(per_file[f]["both"] for f in in_goal)
    if goal_real:
        print(f"goal files: {goal_both} of the {goal_real} tests that pass on DeepSpeed pass on zeroshard "
              f"({100 * goal_both / goal_real:.1f}%)")
    unexplained = 0
    print("\npass on DeepSpeed, not on zeroshard:")
    for test_id in sorted(t for t, o in real.items() if o == "passed" and ours.get(t) != "passed"):
        reason = _reason(test_id, expected)
        unexplained += reason is None
        print(f"  {test_id} [{ours.get(test_id, 'not run')}]: {reason or 'UNEXPECTED'}")
    return unexplained


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a DeepSpeed repository checkout (its tests/ is used)")
    parser.add_argument("--side", choices=("both", "deepspeed", "zeroshard", "compare"), default="both",
                        help="which side to run (compare: run nothing, compare the outcomes --out holds)")
    parser.add_argument("--files", nargs="+", default=list(DEFAULT_FILES),
                        help="test files or globs relative to the checkout (default: DeepSpeed's ZeRO tests)")
    parser.add_argument("--out", type=Path, default=Path("conformance-out"),
                        help="where each side's outcomes accumulate, file by file (an interrupted run resumes)")
    parser.add_argument("--rerun", action="store_true", help="run again the files whose outcomes --out holds")
    parser.add_argument("--timeout", type=int, default=240, help="DeepSpeed's per-test harness timeout, s")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest (e.g. -k zero_config)")
    args = parser.parse_args(argv)
    checkout = args.checkout.resolve()
    if not (checkout / "tests" / "unit" / "common.py").is_file():
        parser.error(f"{checkout} is not a DeepSpeed checkout: tests/unit/common.py is missing")
    files = _expand(checkout, args.files)
    goal = _expand(checkout, list(GOAL_FILES))
    args.out.mkdir(parents=True, exist_ok=True)
    outcomes: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory(prefix="ds-conformance-") as tmp:
        work = Path(tmp)
        shutil.copytree(checkout / "tests", work / "tests")
        for side in ("deepspeed", "zeroshard"):
            if args.side in ("both", side):
                outcomes[side] = _run_side(side, work, files, args.out, args.pytest_args, args.timeout, args.rerun,
                                           load_deselected(HERE / "expected_differences.toml"))
    for side in ("deepspeed", "zeroshard"):
        store = args.out / f"{side}.json"
        if side not in outcomes and store.is_file():
            kept = json.loads(store.read_text())
            outcomes[side] = {t: o for f in files for t, o in kept.get(f, {}).items()}
    if len(outcomes) < 2:
        print("run the other side too to compare (each side's outcomes are kept in --out)")
        return 0
    expected = load_expected(HERE / "expected_differences.toml")
    unexplained = summarize(outcomes["deepspeed"], outcomes["zeroshard"], goal, expected)
    print(f"\n{unexplained} unexplained difference(s)")
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
