"""Telling a failed job from one whose process died in torch's teardown after its work was done.

On CPU, gloo now and then aborts a process while its process group or the interpreter is torn
down ("terminate called without an active exception", SIGABRT), after the script returned. Seen
twice in one CI run (a script that never destroys its group, and, most likely, a 2-node job whose
other node then waited 300 s in torchrun's exit barrier) and once here in a script that calls
``destroy_process_group`` after a barrier (1 of about 14 runs of ``test_multinode``); not reproduced
in 140 launches of the same scripts run by hand. zeroshard now destroys a group it created at exit
(``zeroshard.core.comm.groups``), which torch's own tests needed for this abort (pytorch/pytorch#65231),
but the abort after an explicit destroy remains torch's.

The launcher tests check what a job computed. When every rank wrote its "done" marker (its last
statement, after ``destroy_process_group``) and the only failure is that abort, the results are
whole: the test warns, naming the job, as :mod:`harness` does for its own ranks. Any other failure,
or an abort before a marker, still fails the test.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path

#: What torchrun prints for a worker that std::terminate()d.
ABORT_MARKS = ("terminate called without an active exception", "Signal 6 (SIGABRT)")


def done_markers(out: Path | str, world: int = 2) -> list[Path]:
    """The markers ranks ``0 .. world-1`` of a script writing next to ``out`` touch last:
    ``<out>.rank<R>.done``."""
    return [Path(f"{out}.rank{r}.done") for r in range(world)]


def died_in_teardown(name: str, log: str, done: Iterable[Path], marks: Iterable[str] = ABORT_MARKS) -> bool:
    """Whether job ``name`` failed only by a teardown abort after every ``done`` marker was written
    (and if so, warn). ``marks``: what the log shows of the abort (a process run without torchrun
    prints only the first)."""
    if not all(mark in log for mark in marks) or not all(Path(p).exists() for p in done):
        return False
    warnings.warn(f"{name}: a process died by SIGABRT in torch's teardown after the script finished "
                  "(every rank's done marker is there); its results are checked as they are",
                  RuntimeWarning, stacklevel=2)
    return True
