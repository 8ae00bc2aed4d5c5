"""Failing fast instead of hanging when a collective would run on only some of the ranks.

A collective that some ranks never join blocks the others until the process-group timeout (30
minutes by default), with nothing naming the culprit. Two guards turn that into an error:

- :func:`on_ranks` marks a block of library code that runs on some ranks only (rank 0 writing a
  checkpoint's metadata): any zeroshard collective started inside it raises
  :class:`DistributedError` at once, naming the operation, the block and the ranks that would
  not join. Outside such blocks the cost is one list-emptiness check per collective.
- :func:`arrive` is an arrival check through the default c10d store, for explicit gathers that
  user code may start on a subset of ranks (``if rank == 0: engine.module.state_dict()``): every
  rank posts a key and waits for the others' before the collective. A rank that does not come is
  named in a warning after ``WARN_AFTER_S`` seconds and in a :class:`DistributedError` after the
  arrival timeout (:func:`set_arrival_timeout`, or ``ZEROSHARD_ARRIVAL_TIMEOUT`` in seconds; 120
  by default). Forward and backward never pay for it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from zeroshard.core.comm import watchdog
from zeroshard.errors import DistributedError

logger = logging.getLogger("zeroshard")

ARRIVAL_TIMEOUT_ENV = "ZEROSHARD_ARRIVAL_TIMEOUT"
DEFAULT_ARRIVAL_TIMEOUT_S = 120.0
WARN_AFTER_S = 10.0


class _Blocks(threading.local):
    def __init__(self) -> None:
        self.stack: list[tuple[list[int], str, dist.ProcessGroup | None]] = []


#: The rank-conditional blocks this thread is in, innermost last (checked by every collective).
BLOCKS = _Blocks()


@contextmanager
def on_ranks(ranks: Iterable[int], what: str, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Mark a block that only ``ranks`` (of ``group``) run: a collective started in it raises.

    ``what`` names the block for the error, e.g. ``"preparing the checkpoint, which runs on rank
    0 only"``.
    """
    BLOCKS.stack.append((list(ranks), what, group))
    try:
        yield
    finally:
        BLOCKS.stack.pop()


def refuse(operation: str) -> None:
    """Raise if ``operation`` (a collective about to start) is inside an :func:`on_ranks` block
    that some ranks do not run. Call only when ``BLOCKS.stack`` is not empty (the cheap check)."""
    ranks, what, group = BLOCKS.stack[-1]
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    absent = [r for r in range(world) if r not in ranks]
    if absent:
        raise DistributedError(
            f"{operation} started while {what}: rank{'s' if len(absent) > 1 else ''} "
            f"{', '.join(map(str, absent))} would never join it, so every rank would hang. A collective must "
            "be started by every rank of its group, in the same order."
        )


# -- arrival checks for explicit gathers ------------------------------------------------------------
_timeout_override: float | None = None
_seq = 0
_can_delete = True


def set_arrival_timeout(seconds: float | None) -> None:
    """Seconds an explicit gather waits for the other ranks before raising; ``None`` restores the
    default (``ZEROSHARD_ARRIVAL_TIMEOUT``, else 120)."""
    global _timeout_override
    if seconds is not None and seconds <= 0:
        raise ValueError(f"arrival timeout must be positive, got {seconds}")
    _timeout_override = seconds


def arrival_timeout() -> float:
    """The arrival timeout in seconds now in force."""
    if _timeout_override is not None:
        return _timeout_override
    raw = os.environ.get(ARRIVAL_TIMEOUT_ENV)
    if not raw:
        return DEFAULT_ARRIVAL_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise DistributedError(f"{ARRIVAL_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise DistributedError(f"{ARRIVAL_TIMEOUT_ENV}={raw!r} must be positive")
    return value


def _key(seq: int, global_rank: int) -> str:
    return f"zeroshard/arrive/{seq}/{global_rank}"


def arrive(group: dist.ProcessGroup | None, operation: str, step: int | None = None) -> None:
    """Block until every rank of ``group`` has reached the same explicit gather (its ``n``-th
    call on every rank); raise :class:`DistributedError` naming the missing ranks after the
    arrival timeout. No-op on one rank. Every rank of ``group`` must call it the same number of
    times: one that does not is exactly what it reports.
    """
    global _seq, _can_delete
    if BLOCKS.stack:
        refuse(operation)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    me = dist.get_rank()
    ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    seq = _seq
    keys = [_key(seq, r) for r in ranks]
    store.set(_key(seq, me), "1")
    timeout = arrival_timeout()
    start = time.monotonic()
    try:
        first = min(WARN_AFTER_S, timeout)
        try:  # in slices that raise the watchdog's verdict when a missing rank's process is gone
            watchdog.store_wait(store, keys, timedelta(seconds=first))
        except DistributedError:
            raise
        except RuntimeError:  # DistStoreError: the wait timed out
            if timeout <= first:
                raise
            logger.warning("rank %d: %s is waiting for rank(s) %s, which have not reached it after %.0f s",
                           me, operation, _missing(store, seq, ranks), time.monotonic() - start)
            watchdog.store_wait(store, keys, timedelta(seconds=timeout - first))
    except DistributedError:
        raise
    except RuntimeError:
        missing = _missing(store, seq, ranks)
        _delete(store, _key(seq, me))  # withdraw, so that a later gather starts from the same count
        at = "" if step is None else f" at step {step}"
        raise DistributedError(
            f"{operation}{at}: rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not "
            f"start it within {timeout:.0f} s (rank {me} did). An explicit gather (state_dict(), "
            "GatheredParameters, engine.gathered(), save_16bit_model) under ZeRO-3 is a collective: "
            f"call it on every rank, not under a rank condition. ({ARRIVAL_TIMEOUT_ENV} sets the timeout.)"
        ) from None
    _seq = seq + 1
    if seq >= 2 and _can_delete:  # every rank has passed seq - 2's wait by now
        _can_delete = _delete(store, _key(seq - 2, me))


def _missing(store: dist.Store, seq: int, ranks: list[int]) -> list[int]:
    return [r for r in ranks if not store.check([_key(seq, r)])]


def _delete(store: dist.Store, key: str) -> bool:
    try:
        store.delete_key(key)
        return True
    except (RuntimeError, NotImplementedError):  # a store that cannot delete keeps its keys
        return False
