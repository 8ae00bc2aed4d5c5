"""Failing clearly when a rank dies, stops or never arrives, instead of hanging.

Torch's own mechanisms do the stopping: the process group's timeout makes a gloo collective raise
after it (NCCL's watchdog aborts the communicator after it), and a rank that dies closes its
connections, so its peers' collectives raise at once. What they do not say is *which* rank, doing
*what*. This module adds that, at no cost on the hot path:

- :class:`Heartbeat`: a daemon thread that publishes, every second, this rank's position
  (``forward of step 17``, the last collective started, a counter) to the c10d store.
- :func:`explain`: turns a failed collective into a :class:`DistributedError` that names the
  operation, the step and, from the heartbeats, each peer that is gone or stopped (its counter
  no longer moves) or alive elsewhere (it never started this collective), the lost ones first
  (``lost peers: ranks 2, 3 (all of node 1)``). When the store itself does not answer (its host is
  gone, or the network to it is cut), no heartbeat can be read: the error then says what
  connecting to the store gives and names the ranks on other nodes, none of which can be asked.

The engine sets :data:`STATE`'s ``where`` as it enters forward, backward, the optimizer step and
checkpointing; the collectives in :mod:`zeroshard.core.comm.collectives` set ``op``.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from functools import wraps
from typing import Any, TypeVar

import torch.distributed as dist

from zeroshard.errors import DistributedError

logger = logging.getLogger("zeroshard")

F = TypeVar("F", bound=Callable[..., Any])

HEARTBEAT_S = 1.0
_KEY = "zeroshard/heartbeat/{}"
#: Substrings of the errors torch's backends raise when a collective fails or times out.
_BACKEND_MARKERS = ("gloo", "NCCL", "nccl", "Connection closed", "Connection reset", "Timed out", "timed out",
                    "ProcessGroup", "Broken pipe")


class _State:
    """What this rank is doing, for heartbeats and error messages (plain attribute writes)."""

    __slots__ = ("where", "op")

    def __init__(self) -> None:
        self.where = "set-up"
        self.op = "none yet"


STATE = _State()


class Heartbeat:
    """Publishes this rank's position to the store every :data:`HEARTBEAT_S` seconds."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        self.store = store
        self.rank = rank
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zeroshard-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Ends by itself once the process group is destroyed: nothing is left to report, and a
        # thread still calling into the store while the process tears down can abort it.
        while not self._stop.is_set() and dist.is_initialized():
            self.count += 1
            try:
                self.store.set(_KEY.format(self.rank), f"{self.count}|{STATE.where}|{STATE.op}")
            except Exception:  # the store is gone: the job is ending; explain() will say so
                pass
            self._stop.wait(HEARTBEAT_S)

    def alive(self) -> bool:
        """Whether the thread still runs (it ends with the process group it reports on)."""
        return self._thread.is_alive()

    def stop(self, wait_s: float = 10.0) -> None:
        """End the thread and wait for it (at most ``wait_s``): a thread still inside a store call
        while the interpreter exits takes the process down with ``terminate called without an
        active exception``."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=wait_s)


_heartbeat: Heartbeat | None = None
_store: dist.Store | None = None
_exit_hook = False
#: Set by :func:`explain` when the store did not answer: a heartbeat then waits, inside the store's
#: client, behind the read that never returned, so exiting does not wait for it.
_store_silent = False
#: How long the first read of a heartbeat may take before the store counts as not answering.
STORE_ANSWER_S = 5.0


def _default_store() -> dist.Store | None:
    """The default process group's store (its client is thread-safe). A second client of our own
    would have its own short timeout, but one left connected at exit sometimes took the process
    down with ``terminate called without an active exception`` (1 run in 10 here)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def start_heartbeat() -> None:
    """Start this process's heartbeat (once per process group; a no-op in a world of one)."""
    global _heartbeat, _store, _exit_hook, _store_silent
    store = _default_store() if dist.is_initialized() else None
    if _heartbeat is not None and _heartbeat.alive():
        if _heartbeat.store is store:
            return
        # The group it reported on was destroyed and another created within its last second's
        # sleep (a sweep of trainings in one process): it would keep writing to the dead store.
        _heartbeat.stop()
        _heartbeat = _store = None
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if os.environ.get("ZEROSHARD_HEARTBEAT", "1") == "0":  # opt-out: failures then name no rank
        return
    _store, _store_silent = store, False
    if _store is not None:
        _heartbeat = Heartbeat(_store, dist.get_rank())
        if not _exit_hook:
            atexit.register(_stop_at_exit)
            _exit_hook = True


def _stop_at_exit() -> None:
    """Stop the heartbeat and drop this module's references to the store, so that the store's
    client is destroyed with the process group (by the script, or by ``init_distributed``'s exit
    handler, which runs after this one) while the interpreter is whole, not in its teardown."""
    global _heartbeat, _store
    if _heartbeat is not None:
        _heartbeat.stop(wait_s=0.5 if _store_silent else 10.0)
        _heartbeat.store = None  # type: ignore[assignment]
    _heartbeat = _store = None


def set_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
    """Use ``timeout`` for every later collective of ``group`` (the default group: all)."""
    dist.distributed_c10d._set_pg_timeout(timeout, group)


def _node_of() -> dict[int, int] | None:
    """Each rank's node by torchrun's numbering (``rank = node × LOCAL_WORLD_SIZE + local rank``,
    as :mod:`.topology` reads it); ``None`` without that environment or with uneven nodes."""
    world = dist.get_world_size()
    try:
        local = int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    if local < 1 or world % local:
        return None
    return {r: r // local for r in range(world)}


def _ranks(ranks: list[int], nodes: dict[int, int] | None) -> str:
    """``ranks 2, 3 (all of node 1)``: the ranks, and the nodes they are on when known."""
    text = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    if nodes is None:
        return text
    size, named = Counter(nodes.values()), Counter(nodes[r] for r in ranks)
    parts = [f"all of node {n}" if named[n] == size[n] else f"node {n}" for n in sorted(named)]
    return f"{text} ({'; '.join(parts)})"


def _peers(wait_s: float = 2.5, answered: threading.Event | None = None) -> list[str] | None:
    """The lost peers, then one line per other rank: gone, stopped, or alive and where. ``None``
    when no heartbeat could be read at all. ``answered`` is set once the store's first answer
    (or error) came back."""
    if _store is None or not dist.is_initialized():
        return []
    me, world = dist.get_rank(), dist.get_world_size()

    failed = 0

    def read() -> dict[int, list[str]]:
        nonlocal failed
        out = {}
        for r in range(world):
            if r == me:
                continue
            key = _KEY.format(r)
            try:  # get() would wait for a key that a rank which never started has not written
                out[r] = _store.get(key).decode().split("|", 2) if _store.check([key]) else []
            except Exception:
                out[r] = []
                failed += 1
            if answered is not None:
                answered.set()
        return out

    first = read()
    if first and failed == len(first):  # the store's client fails at once: its connection is gone
        return None
    time.sleep(wait_s)  # a live rank's counter moves within a heartbeat
    second = read()
    lines, lost = [], []
    for r in sorted(first):
        a, b = first[r], second[r]
        if not b:
            lines.append(f"rank {r}: no heartbeat (gone, or the store is unreachable)")
            lost.append(r)
        elif a and a[0] == b[0]:
            lines.append(f"rank {r}: stopped or dead, or cut off from the store (its heartbeat did not move in "
                         f"{wait_s:.1f} s); its last heartbeat (at most {HEARTBEAT_S:.0f} s older) was in {b[1]}, "
                         f"last collective {b[2]}")
            lost.append(r)
        else:
            lines.append(f"rank {r}: alive, in {b[1]}, last collective {b[2]}")
    if lost:
        lines.insert(0, f"lost peers: {_ranks(lost, _node_of())}")
    return lines


def _store_address() -> tuple[str, int] | None:
    """The host and port of the TCP store under the default group's (prefix) store."""
    store = _store
    while store is not None and hasattr(store, "underlying_store"):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host, store.port
    return None


def _silent_store(waited_s: float) -> list[str]:
    """What to say when the store does not answer: what connecting to it gives, and the ranks on
    other nodes (or every other rank), none of which can be asked."""
    global _store_silent
    _store_silent = True
    me, world = dist.get_rank(), dist.get_world_size()
    nodes = _node_of()
    here = [r for r in range(world) if nodes is not None and nodes[r] == nodes[me]] or [me]
    others = [r for r in range(world) if r not in here]
    where = _store_address()
    if where is None:
        store, probe = "the rendezvous store", ""
    else:
        store = f"the rendezvous store at {where[0]}:{where[1]}"
        try:
            socket.create_connection(where, timeout=2.0).close()
            probe = " although it accepts connections (its host process is stopped or overloaded)"
        except OSError as e:
            probe = f"; connecting to it fails ({e}): its host process is gone, or this node is cut off from it"
    why = f"{store} does not answer (waited {waited_s:.0f} s){probe}, so no peer can be asked"
    if not others:
        return [why]
    if nodes is None:
        return [f"lost peers: {_ranks(others, None)}, every other rank: {why}"]
    return [f"lost peers: {_ranks(others, nodes)}, every rank on another node: {why}",
            f"this node runs {_ranks(here, None)}"]


def is_backend_failure(error: BaseException) -> bool:
    """Whether ``error`` is a failed or timed-out collective (not the user's own error)."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _BACKEND_MARKERS)


def _peers_within(seconds: float) -> list[str]:
    """:func:`_peers`, given up after ``seconds``, or after :data:`STORE_ANSWER_S` when the store
    gives no first answer: a store whose host is stopped or cut off blocks its clients."""
    out: list[list[str] | None] = []
    answered = threading.Event()

    def ask() -> None:
        out.append(_peers(answered=answered))
        answered.set()

    t = threading.Thread(target=ask, daemon=True)
    started = time.monotonic()
    t.start()
    if answered.wait(min(seconds, STORE_ANSWER_S)):
        t.join(max(0.0, seconds - (time.monotonic() - started)))
    if out and out[0] is not None:
        return out[0]
    return _silent_store(time.monotonic() - started)


def explain(error: BaseException) -> DistributedError:
    """A :class:`DistributedError` naming what failed, where, and the state of every peer."""
    me = dist.get_rank() if dist.is_initialized() else 0
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    peers = _peers_within(10.0)
    text = (f"rank {me}: {STATE.op} failed in {STATE.where}: {reason[:300]}\n"
            + ("\n".join(f"  {line}" for line in peers) if peers else "  (no heartbeats to tell which rank)")
            + "\nEvery rank must run the same collectives in the same order; a rank that crashed, "
              "stopped or was cut off shows above.")
    return DistributedError(text)


def guarded(where: str) -> Callable[[F], F]:
    """Decorate an engine method: set ``STATE.where`` and turn a failed collective into
    :func:`explain`'s error. ``where`` may use ``{step}`` (the engine's ``global_steps``)."""

    def wrap(fn: F) -> F:
        @wraps(fn)
        def inner(self: Any, *args: Any, **kwargs: Any) -> Any:
            STATE.where = where.format(step=getattr(self, "global_steps", "?"))
            try:
                return fn(self, *args, **kwargs)
            except DistributedError:
                raise
            except Exception as e:
                if is_backend_failure(e):
                    raise explain(e) from e
                raise

        return inner  # type: ignore[return-value]

    return wrap
