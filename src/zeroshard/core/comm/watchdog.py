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
- The same thread watches: a peer whose process is gone must end this rank's waits within
  seconds, even where nothing else would (gloo wakes neither a receive whose message had started
  to arrive nor a send partly written when the peer's connection closes: their waits sleep until
  the collective timeout, 10 minutes by default). Each second it reads its two ring neighbours'
  heartbeats; one that stood still for :data:`STALE_S` is probed on the small TCP port each rank
  listens on (:class:`_ProbePort`). A refused connection is the peer's host saying that no such
  process exists: the *verdict* names every rank whose port refuses (probed all), is published
  through the store for every rank, and the waits of :mod:`.collectives` (:func:`wait_work`, in
  slices of :data:`WAIT_SLICE_S`) raise it as a :class:`DistributedError`. A rank still inside an
  engine call :data:`EXIT_GRACE_S` later (blocked where no slice reaches: torch's own waits, a
  store wait) prints it and exits. Silence (a cut link, a stopped process, an overloaded host) is
  no verdict: it is left to the collective timeout, as before.

The engine sets :data:`STATE`'s ``where`` as it enters forward, backward, the optimizer step and
checkpointing; the collectives in :mod:`zeroshard.core.comm.collectives` set ``op``.
"""

from __future__ import annotations

import atexit
import ipaddress
import logging
import os
import queue
import socket
import sys
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
#: the address of each rank's probe port, ``host|port|hostname``
_PROBE_KEY = "zeroshard/probe/{}"
#: the verdict, once a rank found a peer's process gone: ``finder rank|line|line...``
_LOST_KEY = "zeroshard/lost"
#: how often the watchdog looks at its neighbours' heartbeats and at the published verdict
WATCH_S = 0.5
#: how long a neighbour's heartbeat may stand still before its probe port is asked (a live rank's
#: moves every :data:`HEARTBEAT_S`; a probe of a live process costs one accepted connection)
STALE_S = 2.5
#: how long a probe may take before it counts as no answer (silence is never a verdict)
PROBE_TIMEOUT_S = 1.0
#: waits on collectives check the verdict this often
WAIT_SLICE_S = 0.1
#: after a verdict, how long a rank still inside an engine call (blocked where no slice reaches) is
#: given before it prints the verdict and exits
EXIT_GRACE_S = 3.0
#: Substrings of the errors torch's backends raise when a collective fails or times out.
_BACKEND_MARKERS = ("gloo", "NCCL", "nccl", "Connection closed", "Connection reset", "Timed out", "timed out",
                    "ProcessGroup", "Broken pipe")


class _State:
    """What this rank is doing, for heartbeats and error messages (plain attribute writes)."""

    __slots__ = ("where", "op", "active")

    def __init__(self) -> None:
        self.where = "set-up"
        self.op = "none yet"
        self.active = 0  # engine calls (guarded) the main thread is inside


STATE = _State()


class _ProbePort:
    """A listening TCP socket that only says this process exists: a peer that connects is accepted
    (and dropped), and once the process is gone its host refuses the connection. Bound to the
    address this host routes to the rendezvous store by, which the other nodes can reach; closed
    in forked children (data loader workers), which would otherwise keep it answering."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        host = _route_address()
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sock.listen(128)
            sock.setblocking(False)
        except OSError as e:
            logger.debug("zeroshard watchdog: no probe port (%s)", e)
            return
        self.sock, self.host, self.port = sock, host, sock.getsockname()[1]

    def drain(self) -> None:
        """Accept and close the probes that came (their connections are already counted)."""
        while self.sock is not None:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.close()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


_port: _ProbePort | None = None


def _probe_port() -> _ProbePort:
    """The process's probe port, opened once: it answers as long as the process lives, whatever
    process groups come and go (a peer that moved to a new group is not gone)."""
    global _port
    if _port is None or _port.sock is None:
        _port = _ProbePort()
    return _port


def _route_address() -> str:
    """This host's address on the route to the rendezvous store (no packet is sent)."""
    where = _store_address()
    if where is None:
        return "127.0.0.1"
    try:
        family, _, _, _, address = socket.getaddrinfo(where[0], where[1], type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(address)
            return str(s.getsockname()[0])
    except (OSError, IndexError):
        return "127.0.0.1"


def _probe(address: tuple[str, int, str]) -> bool | None:
    """Whether the process behind a probe port exists: ``True`` (accepted), ``False`` (refused: its
    host has no such listener, the process is gone), ``None`` (no answer in time, unreachable, or a
    loopback address of another host, which cannot be asked from here)."""
    host, port, hostname = address
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback and hostname != socket.gethostname():
        return None
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
        return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None


class Heartbeat:
    """Publishes this rank's position to the store every :data:`HEARTBEAT_S` seconds, and watches
    its ring neighbours for a process that is gone (module documentation)."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        self.store = store
        self.rank = rank
        self.world = dist.get_world_size()
        self.count = 0
        self._stop = threading.Event()
        self.clean = True  # cleared when the process exits by an uncaught exception
        self._port = _probe_port()
        self._addresses: dict[int, tuple[str, int, str]] = {}
        # neighbour -> (its last heartbeat counter seen, when it was first seen, seen moving yet)
        self._seen: dict[int, tuple[str, float, bool]] = {}
        self._neighbours = sorted({(rank + 1) % self.world, (rank - 1) % self.world} - {rank})
        self._thread = threading.Thread(target=self._run, name="zeroshard-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Ends by itself once the process group is destroyed: nothing is left to report, and a
        # thread still calling into the store while the process tears down can abort it.
        try:
            self.store.delete_key(_LOST_KEY)  # a verdict an earlier job left in the same store
        except Exception:
            pass
        if self._port.sock is not None:
            try:
                self.store.set(_PROBE_KEY.format(self.rank), f"{self._port.host}|{self._port.port}|"
                                                            f"{socket.gethostname()}")
            except Exception:
                pass
        next_beat = 0.0
        while not self._stop.is_set() and dist.is_initialized():
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + HEARTBEAT_S
                self.count += 1
                try:
                    self.store.set(_KEY.format(self.rank), f"{self.count}|{STATE.where}|{STATE.op}")
                except Exception:  # the store is gone: the job is ending; explain() will say so
                    pass
            self._port.drain()
            if _verdict is None:
                try:
                    self._watch()
                except Exception as e:  # never let the watch take the heartbeat down
                    logger.debug("zeroshard watchdog: %s", e)
            self._stop.wait(WATCH_S)
        if self.clean:  # the group destroyed, or a clean exit: peers must not take this silence for a death
            try:
                self.store.set(_KEY.format(self.rank), f"{self.count}|exited|{STATE.op}")
            except Exception:
                pass

    # -- the watch -------------------------------------------------------------------------------

    def _address(self, r: int) -> tuple[str, int, str] | None:
        if r not in self._addresses:
            key = _PROBE_KEY.format(r)
            if not self.store.check([key]):
                return None
            host, port, hostname = self.store.get(key).decode().split("|", 2)
            self._addresses[r] = (host, int(port), hostname)
        return self._addresses[r]

    def _watch(self) -> None:
        """One look: adopt a verdict another rank published; else probe the neighbours whose
        heartbeat, seen moving in this job, stood still for :data:`STALE_S` (all of them, when the
        store fails: its host may be gone with them)."""
        now = time.monotonic()
        suspects = []
        try:
            if self.store.check([_LOST_KEY]):
                finder, *lines = self.store.get(_LOST_KEY).decode().split("\n")
                _set_verdict(lines, int(finder))
                return
            for r in self._neighbours:
                key = _KEY.format(r)
                beat = self.store.get(key).decode().split("|", 2) if self.store.check([key]) else None
                if beat is None or beat[1] == "exited":  # not started yet, or ended cleanly
                    self._seen.pop(r, None)
                    continue
                last = self._seen.get(r)
                if last is None:  # a counter left by an earlier job in the same store is never judged
                    self._seen[r] = (beat[0], now, False)
                elif last[0] != beat[0]:
                    self._seen[r] = (beat[0], now, True)
                    self._address(r)  # written before its first heartbeat: this job's
                elif last[2] and now - last[1] >= STALE_S:
                    suspects.append(r)
        except Exception:  # the store fails (its host may be gone): ask the neighbours themselves
            suspects = [r for r in self._neighbours if r in self._addresses]
        if any(_probe(self._addresses[r]) is False for r in suspects if r in self._addresses):
            self._judge()

    def _address_or_none(self, r: int) -> bool:
        try:
            return self._address(r) is not None
        except Exception:
            return r in self._addresses

    def _judge(self) -> None:
        """A neighbour's process is gone: probe every rank, name the gone ones, publish the verdict."""
        states: dict[int, bool | None] = {}
        for r in range(self.world):
            if r != self.rank:
                states[r] = _probe(self._addresses[r]) if self._address_or_none(r) else None
        beats: dict[int, list[str]] = {}
        try:
            for r in states:
                key = _KEY.format(r)
                beats[r] = self.store.get(key).decode().split("|", 2) if self.store.check([key]) else []
        except Exception:
            pass
        lost = [r for r, alive in states.items() if alive is False and (beats.get(r) or ["", ""])[1] != "exited"]
        if not lost:
            return
        lines = [f"lost peers: {_ranks(lost, _node_of())}"]
        for r, alive in states.items():
            b = beats.get(r) or []
            last = f"; its last heartbeat was in {b[1]}, last collective {b[2]}" if len(b) == 3 else ""
            if alive is False:
                host, port, _ = self._addresses[r]
                lines.append(f"rank {r}: stopped or dead: its process is gone (its heartbeat stood still and "
                             f"its watchdog port {host}:{port} refuses connections){last}")
            elif alive:
                lines.append(f"rank {r}: alive" + (f", in {b[1]}, last collective {b[2]}" if len(b) == 3 else ""))
            else:
                lines.append(f"rank {r}: no answer from its watchdog port{last}")
        _set_verdict(lines, self.rank)
        try:
            self.store.set(_LOST_KEY, "\n".join([str(self.rank), *lines]))
        except Exception:
            pass

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


# -- the verdict and the waits that raise it ----------------------------------------------------

#: what the watchdog found: the lines naming the lost peers (``None``: nothing)
_verdict: list[str] | None = None
_verdict_by = -1
_verdict_lock = threading.Lock()
#: set with the verdict: sliced waits wake on it
LOST = threading.Event()
_generation = 0  # counts the process groups watched: a verdict ends only the group it was found in


def _set_verdict(lines: list[str], finder: int) -> None:
    """Record the verdict (once), wake what can be woken, and make sure this process ends."""
    global _verdict, _verdict_by
    with _verdict_lock:
        if _verdict is not None:
            return
        _verdict, _verdict_by = lines, finder
    LOST.set()
    logger.error("rank %d: %s (found by %s); waits on collectives now raise it", _me(), lines[0] if lines else "",
                 "this rank's watchdog" if finder == _me() else f"rank {finder}'s watchdog")
    _abort_accelerator_groups()
    threading.Thread(target=_end_if_stuck, args=(_generation,), name="zeroshard-lost", daemon=True).start()


def _clear_verdict() -> None:
    """A new process group starts with no verdict."""
    global _verdict, _verdict_by, _generation
    with _verdict_lock:
        _verdict, _verdict_by = None, -1
        _generation += 1
    LOST.clear()


def _abort_accelerator_groups() -> None:
    """NCCL's waits are woken by aborting the communicators (gloo's are not: its waits are sliced
    instead, :func:`wait_work`)."""
    try:
        if dist.is_initialized() and "nccl" in str(dist.get_backend()).lower():
            dist.distributed_c10d._abort_process_group()
    except Exception as e:
        logger.debug("zeroshard watchdog: abort failed: %s", e)


def _end_if_stuck(generation: int) -> None:
    """Give the main thread :data:`EXIT_GRACE_S` to raise the verdict out of the engine; if it is
    still inside an engine call then, it is blocked where no slice reaches: print and exit."""
    time.sleep(EXIT_GRACE_S)
    if STATE.active > 0 and generation == _generation and _verdict is not None:
        _exit_now(f"{lost_error().args[0]}\n(rank {_me()} was blocked {EXIT_GRACE_S:.0f} s after the verdict, "
                  f"in {STATE.op}: exiting)")


def _exit_now(text: str) -> None:
    try:
        sys.stderr.write(f"zeroshard: {text}\n")
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(1)


def _me() -> int:
    try:
        return dist.get_rank()
    except Exception:
        return -1


def lost() -> bool:
    """Whether a peer's process was found gone."""
    return _verdict is not None


def lost_error(reason: str | None = None) -> DistributedError:
    """The verdict as the error of this rank's current operation."""
    me = _me()
    finder = "this rank's watchdog" if _verdict_by == me else f"rank {_verdict_by}'s watchdog"
    reason = reason or f"a peer's process is gone (found by {finder} while this rank waited)"
    lines = _verdict or []
    return DistributedError(
        f"rank {me}: {STATE.op} failed in {STATE.where}: {reason}\n" + "\n".join(f"  {line}" for line in lines)
        + "\nEvery rank must run the same collectives in the same order; a rank that crashed, "
          "stopped or was cut off shows above.")


def raise_if_lost() -> None:
    """Raise the verdict, if there is one."""
    if _verdict is not None:
        raise lost_error()


class _Waiter:
    """A thread that runs the blocking waits of one calling thread, so that the caller waits in
    slices that check the verdict (a gloo point-to-point wait cannot be cut into slices: one that
    times out closes the connection for good)."""

    def __init__(self) -> None:
        self.owner = threading.current_thread()
        self.jobs: queue.SimpleQueue[tuple[Callable[[], object], threading.Event, list[BaseException]]] = \
            queue.SimpleQueue()
        threading.Thread(target=self._run, name="zeroshard-wait", daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                job, done, error = self.jobs.get(timeout=5.0)
            except queue.Empty:
                if not self.owner.is_alive():  # ends with the thread it waits for
                    return
                continue
            try:
                job()
            except BaseException as e:
                error.append(e)
            # the job holds the collective's handle and through it its tensors: kept in this frame until
            # the next job, it would keep buffers alive that the caller has let go (offload_states frees them)
            del job
            done.set()


_waiters = threading.local()


def watching() -> bool:
    """Whether this process's watchdog runs (waits are then sliced)."""
    return _heartbeat is not None and _heartbeat.alive()


def _until(done: threading.Event) -> None:
    while not done.wait(WAIT_SLICE_S):
        raise_if_lost()


def run_blocking(job: Callable[[], object]) -> None:
    """Run ``job`` (blocking waits on collectives, and what follows each: a ring's next hop) on
    this thread's waiter while this thread waits in slices of :data:`WAIT_SLICE_S` that raise the
    watchdog's verdict as soon as there is one; ``job``'s own error is raised here. One hand-over
    per call: give it every wait that runs back to back. Without a watchdog, ``job()`` here."""
    if not watching():
        job()
        return
    raise_if_lost()
    waiter = getattr(_waiters, "waiter", None)
    if waiter is None:
        waiter = _waiters.waiter = _Waiter()
    done, error = threading.Event(), []  # type: tuple[threading.Event, list[BaseException]]
    waiter.jobs.put((job, done, error))
    _until(done)
    if error:
        raise error[0]


def wait_work(work: Any, timeout: Any = None) -> None:
    """``work.wait(timeout)`` for a host-side (gloo) collective, in slices that raise the watchdog's
    verdict: a collective's handle completes a future, which wakes this thread directly; a
    point-to-point one has none, and waits on the waiter (:func:`run_blocking`). Without a
    watchdog, a plain wait."""
    if not watching():
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)
        return
    raise_if_lost()
    try:
        future = work.get_future()
    except Exception:  # gloo's send and receive handles have no future
        future = None
    if future is not None:
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        _until(done)
        work.wait()  # at once: raises the collective's own error, if any
        return
    run_blocking(lambda: work.wait() if timeout is None else work.wait(timeout))


_heartbeat: Heartbeat | None = None
_store: dist.Store | None = None
_exit_hook = False
#: Set by :func:`explain` when the store did not answer: a heartbeat then waits, inside the store's
#: client, behind the read that never returned, so exiting does not wait for it.
_store_silent = False
#: How long the first read of a heartbeat may take before the store counts as not answering.
STORE_ANSWER_S = 5.0


def _close_port_in_child() -> None:
    """A forked child (a data loader worker) must not keep its parent's probe port answering."""
    global _port
    if _port is not None:
        _port.close()
        _port = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_port_in_child)


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
    _clear_verdict()
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
    if _verdict is not None:  # a peer is gone: the teardown could wait on collectives that never end
        _exit_now(f"exiting after a lost peer (rank {_me()}): {_verdict[0] if _verdict else ''}")
    if _heartbeat is not None:
        # an uncaught exception (printed, so in sys.last_value) is no clean end: its peers may judge it
        _heartbeat.clean = getattr(sys, "last_value", None) is None
        _heartbeat.stop(wait_s=0.5 if _store_silent else 10.0)
        _heartbeat.store = None  # type: ignore[assignment]
    _heartbeat = _store = None


#: a store wait checks the verdict this often (each slice is one more request to the store)
STORE_SLICE_S = 0.5


def store_wait(store: dist.Store, keys: list[str], timeout: timedelta) -> None:
    """``store.wait(keys, timeout)`` in slices that raise the watchdog's verdict: a key that a rank
    whose process is gone would have set never comes. Raises the store's own error at ``timeout``."""
    if not watching():
        store.wait(keys, timeout)
        return
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        raise_if_lost()
        left = deadline - time.monotonic()
        try:
            store.wait(keys, timedelta(seconds=max(0.001, min(STORE_SLICE_S, left))))
            return
        except RuntimeError:  # DistStoreError: this slice timed out
            if time.monotonic() >= deadline:
                raise


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
    if _verdict is None and watching() and "imed out" not in reason:  # a peer just gone: a moment to name it
        LOST.wait(STALE_S + 2 * WATCH_S + PROBE_TIMEOUT_S)
    if _verdict is not None:
        return lost_error(reason[:300])
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
            STATE.active += 1
            try:
                raise_if_lost()
                return fn(self, *args, **kwargs)
            except DistributedError:
                raise
            except Exception as e:
                if is_backend_failure(e):
                    raise explain(e) from e
                raise
            finally:
                STATE.active -= 1

        return inner  # type: ignore[return-value]

    return wrap
