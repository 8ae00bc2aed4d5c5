"""Crash-safe file system steps of a save, and the fault points the kill tests use.

A checkpoint becomes visible in one ``rename``: everything is written into a hidden temporary
directory, fsynced, and only then renamed to its tag; ``latest`` is replaced the same way, last.
A process killed at any moment therefore leaves either the previous state or the new, complete
one, plus possibly a ``.tmp-*`` directory that no loader ever reads.

Fault points: when the environment variable ``ZEROSHARD_CHECKPOINT_FAULT`` is
``PHASE`` or ``PHASE@RANK``, the process SIGKILLs itself on reaching that phase of a save (on
rank ``RANK`` only, when given). Tests use it to kill a rank at a chosen moment; :data:`PHASES`
lists the phases in the order a save reaches them.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
from pathlib import Path

FAULT_ENV = "ZEROSHARD_CHECKPOINT_FAULT"

#: Phases of a save, in order; see :func:`fault_point`.
PHASES = (
    "begin",           # temporary directory created, nothing written
    "shard_partial",   # this rank's shard file half written (after its first tensor)
    "shard_written",   # this rank's shard file complete and fsynced, before the barrier
    "meta_written",    # rank 0: metadata written, completion marker not yet
    "marker_written",  # rank 0: completion marker written, directory not yet renamed
    "renamed",         # rank 0: checkpoint visible under its tag, ``latest`` not yet updated
    "latest_partial",  # rank 0: new ``latest`` written to its temporary name, not yet renamed
    "done",            # everything published
)

TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"


def fault_point(phase: str, rank: int) -> None:
    """SIGKILL this process if ``ZEROSHARD_CHECKPOINT_FAULT`` names this phase (and rank)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    name, _, who = spec.partition("@")
    if name == phase and (not who or int(who) == rank):
        os.kill(os.getpid(), signal.SIGKILL)


def new_nonce() -> str:
    """A short random suffix for temporary names."""
    return secrets.token_hex(4)


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entry to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: Path, data: bytes, rank: int = 0, fault: str | None = None) -> None:
    """Replace ``path`` with ``data`` atomically: temporary name, fsync, rename, fsync the directory."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{new_nonce()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if fault:
        fault_point(fault, rank)
    os.replace(tmp, path)
    fsync_path(path.parent)


def write_file_durable(path: Path, data: bytes) -> None:
    """Write a new file inside a not-yet-published directory and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def publish_dir(tmp: Path, final: Path) -> None:
    """Rename the complete directory ``tmp`` to ``final``, replacing an older ``final`` safely.

    An existing ``final`` is first renamed aside to ``.old-<name>-<nonce>`` and deleted only after
    the new directory is in place; a crash in between leaves that complete copy, which
    :func:`zeroshard.checkpoint.paths.resolve_checkpoint` falls back to.
    """
    fsync_path(tmp)
    aside = None
    if final.exists():
        aside = final.with_name(f"{OLD_PREFIX}{final.name}-{new_nonce()}")
        os.rename(final, aside)
    os.rename(tmp, final)
    fsync_path(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
