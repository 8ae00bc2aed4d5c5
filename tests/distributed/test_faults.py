"""Fault injection in CI: a few of ``scripts/fault_trials.py``'s trials (see ``tests/faults.py``).

A 2-rank job under ``zeroshard launch`` loses a rank (SIGKILL or SIGSTOP) and must end within
the collective timeout plus a margin, with an error naming the lost rank, leaving no process
behind and its latest checkpoint intact; with ``--max_restarts 1`` it must resume from that
checkpoint by itself (``checkpoint.auto_resume``) and end with the uninterrupted run's parameters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from faults import Fault, check, run_trial

#: (fault, restarts): a death and a stop without restarts, a death mid-backward with one restart.
TRIALS = [
    (Fault(rank=1, step=2, point="backward", kind="kill"), 0),
    (Fault(rank=0, step=3, point="forward", kind="stop"), 0),
    (Fault(rank=1, step=4, point="step", kind="kill"), 1),
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    outcome = run_trial(tmp_path_factory.mktemp("reference"), None)
    assert outcome.code == 0 and outcome.params is not None, outcome.stderr[-3000:]
    assert outcome.latest_ok and not outcome.leftovers
    return outcome.params


@pytest.mark.parametrize(("fault", "restarts"), TRIALS, ids=lambda v: v.env() if isinstance(v, Fault) else str(v))
def test_a_lost_rank_ends_the_job_clearly(fault: Fault, restarts: int, reference: dict, tmp_path: Path) -> None:
    outcome = run_trial(tmp_path, fault, restarts)
    problems = check(outcome, fault, restarts, reference)
    assert not problems, f"{fault} (restarts {restarts}), {outcome.seconds:.0f} s:\n" + "\n".join(problems)
