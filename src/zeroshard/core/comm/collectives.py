"""Collectives as plain functions over an explicit process group.

Each returns an async handle (``torch.distributed.Work``) when ``async_op`` is set; callers wait
on it before touching the output. Nothing here reads a global group: the engine passes its group
down. Shape agreement is checked once at set-up (:func:`check_same_across_ranks`) because a size
mismatch inside a collective hangs instead of raising. Every collective here raises at once when
started inside an :func:`on_ranks` block (code that some ranks do not run; see
:mod:`zeroshard.core.comm.subset`), and goes through :func:`_logged`, where the communication logger
(:mod:`zeroshard.monitor.comms`) times it while one is installed in :data:`HOOK`.

Every wait on a host-side (gloo) collective, point-to-point rings included, goes through
:func:`~zeroshard.core.comm.watchdog.wait_work`: in slices that raise the watchdog's verdict when a
peer's process is gone, instead of one wait that gloo may never wake (:class:`Watched`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from zeroshard.core import host_memory
from zeroshard.core.comm import watchdog
from zeroshard.core.comm.subset import BLOCKS, refuse
from zeroshard.core.comm.subset import on_ranks as on_ranks  # C.on_ranks(ranks, what), next to what it guards
from zeroshard.core.comm.topology import WORLD, level_of
from zeroshard.core.comm.watchdog import STATE
from zeroshard.core.partition import consecutive_runs
from zeroshard.errors import DistributedError

ProcessGroup = dist.ProcessGroup

# torch 2.13 renamed the flat-tensor collectives; older releases only have the *_tensor names.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class _Waitable(Protocol):
    def wait(self) -> object: ...


_W = TypeVar("_W", bound="_Waitable | None")


class Recorder(Protocol):
    """What the communication logger (:mod:`zeroshard.monitor.comms`) offers the collectives."""

    def run(self, op: str, nbytes: int, device: torch.device, launch: Callable[[], _W], level: str = WORLD) -> _W:
        """Run ``launch`` (which starts collective ``op`` over ``nbytes`` between ranks ``level``
        apart: :mod:`.topology`), measure and record it."""
        ...


class CommsHook:
    """Where a communication logger plugs in: ``recorder`` is ``None`` while none is on, and then
    a collective pays one attribute check (:func:`_logged`)."""

    recorder: Recorder | None = None


#: the process's communication logger slot (one per process, like DeepSpeed's ``comms_logger``)
HOOK = CommsHook()


def _logged(op: str, nbytes: int, device: torch.device, launch: Callable[[], _W],
            group: ProcessGroup | None = None) -> _W:
    """Start a collective over ``group`` through ``launch``, handing it to the communication logger
    when one is on. ``op`` is DeepSpeed's name for it and ``nbytes`` the whole buffer (nccl-tests'
    size: the gathered output of an all-gather, the unreduced input of a reduce-scatter)."""
    recorder = HOOK.recorder
    if recorder is None:
        return launch()
    return recorder.run(op, nbytes, device, launch, level_of(group))


class Watched:
    """A host-side (gloo) collective's handle whose :meth:`wait` is done in slices that check the
    watchdog's verdict (:func:`~zeroshard.core.comm.watchdog.wait_work`); everything else is the
    handle's own."""

    __slots__ = ("work",)

    def __init__(self, work: dist.Work) -> None:
        self.work = work

    def wait(self, timeout: timedelta | None = None) -> bool:
        watchdog.wait_work(self.work, timeout)
        return True

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def _watched(work: Any, device: torch.device) -> Any:
    """``work`` made :class:`Watched` when it runs on the host (gloo); an accelerator's (NCCL) wait
    only orders streams and is woken by the watchdog's abort, so it stays as it is."""
    if work is None or device.type != "cpu" or isinstance(work, Watched):
        return work
    return Watched(work)


def _collective(op: str, tensor: torch.Tensor, group: ProcessGroup | None, async_op: bool,
                start: Callable[[bool], Any]) -> dist.Work | None:
    """Launch ``start(async_op)`` through :func:`_logged` (``tensor``: the one whose bytes are counted).
    On the host a blocking collective is started asynchronously and waited here, in the watchdog's
    slices (:class:`Watched`); an accelerator's keeps its own blocking call."""
    host = tensor.device.type == "cpu"
    work: dist.Work | None = _logged(op, _nbytes(tensor), tensor.device,
                                     lambda: _watched(start(async_op or host), tensor.device), group)
    if async_op:
        return work
    _sync(work)
    return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _begin(operation: str) -> None:
    """Every collective starts here: recorded for failure messages (:mod:`.watchdog`), and refused
    inside a block that some ranks do not run (:mod:`.subset`)."""
    STATE.op = operation
    if BLOCKS.stack:
        refuse(operation)


def _group_timeout(group: ProcessGroup | None) -> timedelta:
    """The timeout of ``group``'s CPU backend (what its collectives wait at most)."""
    pg = group if group is not None else dist.group.WORLD
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout  # type: ignore[union-attr]
    except (AttributeError, RuntimeError):
        return timedelta(minutes=10)


def control_device(group: ProcessGroup | None) -> torch.device:
    """Where small control tensors (flags, sizes, digests) go: the CPU when ``group`` has a CPU
    backend (gloo, or zeroshard's own ``cpu:gloo,cuda:nccl`` group), else the current CUDA device
    (a process group the user created with NCCL alone moves CUDA tensors only)."""
    pg = group if group is not None else dist.group.WORLD
    try:
        pg._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
    except (RuntimeError, AttributeError):
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def world_size(group: ProcessGroup | None) -> int:
    """Size of ``group`` (1 when torch.distributed is not initialized)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def rank(group: ProcessGroup | None) -> int:
    """This process's rank in ``group`` (0 when torch.distributed is not initialized)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


class ReducedRow:
    """A pending reduction of a ``[world, n]`` buffer whose :meth:`wait` returns this rank's row."""

    def __init__(self, work: dist.Work | None, row: torch.Tensor) -> None:
        self.work, self.row = work, row

    def wait(self) -> torch.Tensor:
        """Block until the collective is done; this rank's summed row (``n`` elements)."""
        if self.work is not None:
            self.work.wait()
        return self.row


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup | None,
                   async_op: bool = True) -> dist.Work | None:
    """Sum ``inp`` (``world * out.numel()`` elements) across ranks; rank r receives chunk r."""
    _begin("reduce-scatter")
    if world_size(group) == 1:
        out.copy_(inp)
        return None
    return _collective("reduce_scatter_tensor", inp, group, async_op,
                       lambda a: _reduce_scatter_flat(out, inp, group=group, async_op=a))


class _Ring:
    """``world - 1`` hops of point-to-point messages around the ring of ranks: in each, rank ``r``
    sends one buffer to ``r + 1`` and receives one from ``r - 1``. Subclasses name the two buffers
    of a hop (:meth:`_hop`) and what to do once it has arrived (:meth:`_arrived`). The first hop
    starts at once; later ones in :meth:`_finish`."""

    def _begin_ring(self, group: ProcessGroup | None, tag: int) -> None:
        self.n, self.r, self.group, self.tag = world_size(group), rank(group), group, tag
        # gloo's point-to-point waits ignore the group's timeout unless given one: a stopped peer
        # would block them forever.
        self.timeout = _group_timeout(group)
        self.next = _global_rank(group, (self.r + 1) % self.n)
        self.prev = _global_rank(group, (self.r - 1) % self.n)
        self.step = 0
        self.works: list[dist.Work | None] | None = self._post()

    def _hop(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _arrived(self) -> None:
        """Called after each hop's messages are done."""

    def _post(self) -> list[dist.Work | None]:
        send, recv = self._hop()
        return [dist.isend(send, self.next, group=self.group, tag=self.tag),
                dist.irecv(recv, self.prev, group=self.group, tag=self.tag)]

    def _finish(self) -> None:
        # gloo wakes neither a receive whose message had begun to arrive nor a send partly written
        # when the peer dies: every hop runs on the watchdog's waiter, whose verdict ends the wait
        if self.works is not None:
            watchdog.run_blocking(self._hops)

    def _hops(self) -> None:
        while self.works is not None:
            for w in self.works:
                if w is not None:
                    w.wait(self.timeout)
            self._arrived()
            self.step += 1
            self.works = self._post() if self.step < self.n - 1 else None


class _RingReduceScatter(_Ring, ReducedRow):
    """A reduce-scatter around the ring: in each hop rank ``r`` sends its partial sum of one
    chunk and adds the chunk received, ending with its own chunk summed. It moves half the bytes
    of an all-reduce."""

    def __init__(self, buf: torch.Tensor, group: ProcessGroup | None, tag: int) -> None:
        n, r = world_size(group), rank(group)
        self.chunks = buf.view(n, -1)
        self.recv = host_memory.empty(self.chunks.shape[1], buf.dtype, buf.device)  # not in the heap on CPU
        ReducedRow.__init__(self, None, self.chunks[r])
        self._begin_ring(group, tag)

    def _hop(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.chunks[(self.r - self.step - 1) % self.n], self.recv

    def _arrived(self) -> None:
        self.chunks[(self.r - self.step - 2) % self.n].add_(self.recv)

    def wait(self) -> torch.Tensor:
        self._finish()
        return self.row


def reduce_scatter_rows(buf: torch.Tensor, group: ProcessGroup | None, tag: int = 0) -> ReducedRow:
    """Reduce-scatter a scratch buffer laid out ``[world, n]``; the caller gives ``buf`` up.

    gloo has no native reduce-scatter (torch runs it as a clone of the input, an all-reduce and a
    copy), so there the sum travels around the ring in point-to-point messages, in place, at
    half the bytes of an all-reduce (docs/performance.md); ``tag`` tells apart the reductions
    in flight at once (every rank must pass the same). Other backends (NCCL) run a real
    reduce-scatter into a new row.
    """
    _begin(f"reduce-scatter of bucket {tag}")
    n = world_size(group)
    rows = buf.view(n, -1)
    if n == 1:
        return ReducedRow(None, rows[0])
    if dist.get_backend(group) == "gloo":
        return _logged("reduce_scatter_tensor", _nbytes(buf), buf.device,
                       lambda: _RingReduceScatter(buf, group, tag), group)
    out = torch.empty(rows.shape[1], dtype=buf.dtype, device=buf.device)
    return _logged("reduce_scatter_tensor", _nbytes(buf), buf.device,
                   lambda: ReducedRow(_watched(_reduce_scatter_flat(out, buf, group=group, async_op=True), buf.device),
                                      out), group)


class _RingAllGather(_Ring):
    """An all-gather around the ring, straight into ``out``: each row travels ``world - 1`` hops
    and lands in its place.

    gloo's own all-gather allocates temporaries of the output's size on every call; freed
    through malloc they stay in the process (measured: 5 all-gathers of 26 MiB left 105 MiB of
    resident heap, ``docs/performance.md``). This moves the same bytes as gloo's ring with no
    temporary. Every all-gather shares one tag: ranks post them in the same order, and gloo
    matches the messages of a pair and tag in order.
    """

    TAG = 1 << 24  # apart from the reduce-scatter rings' bucket tags

    def __init__(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup | None) -> None:
        n, r = world_size(group), rank(group)
        self.rows = out.view(n, -1)
        if inp.data_ptr() != self.rows[r].data_ptr():  # not gathered in place
            self.rows[r].copy_(inp.reshape(-1))
        self._begin_ring(group, self.TAG)

    def _hop(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows[(self.r - self.step) % self.n], self.rows[(self.r - self.step - 1) % self.n]

    def wait(self) -> bool:
        self._finish()
        return True


def input_copied(work: Any) -> bool:
    """Whether an all-gather returned by :func:`all_gather` no longer reads its input: the ring
    copies it into its row of the output when it starts, and one rank's copies it at once."""
    return work is None or isinstance(work, _RingAllGather)


def _global_rank(group: ProcessGroup | None, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup | None,
               async_op: bool = True, what: str = "all-gather") -> dist.Work | None:
    """Concatenate every rank's ``inp`` into ``out`` in rank order (``what`` names it in errors).

    Large gathers of CPU tensors over gloo go around a ring of point-to-point messages
    (:class:`_RingAllGather`); small ones (control rows, whose sizes may differ between ranks when
    something is wrong) keep gloo's collective, which reports a mismatch instead of hanging.
    """
    _begin(what)
    if world_size(group) == 1:
        out.copy_(inp)
        return None
    large = _nbytes(out) >= host_memory.MAPPED_MIN_BYTES
    if out.device.type == "cpu" and large and dist.get_backend(group) == "gloo":
        def ring() -> Any:
            work = _RingAllGather(out, inp, group)
            if not async_op:
                work.wait()
                return None
            return work
        ringed: dist.Work | None = _logged("all_gather_into_tensor", _nbytes(out), out.device, ring, group)
        return ringed
    return _collective("all_gather_into_tensor", out, group, async_op,
                       lambda a: _all_gather_flat(out, inp, group=group, async_op=a))


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, async_op: bool = True,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> dist.Work | None:
    """In-place reduction of ``tensor`` across ranks."""
    _begin("all-reduce")
    if world_size(group) == 1:
        return None
    return _collective("all_reduce", tensor, group, async_op,
                       lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a))


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None) -> None:
    """Blocking broadcast from global rank ``src``."""
    _begin("broadcast")
    if world_size(group) > 1:
        _collective("broadcast", tensor, group, False, partial(_start_broadcast, tensor, src, group))


def barrier(group: ProcessGroup | None) -> None:
    """Block until every rank of ``group`` reaches it."""
    _begin("barrier")
    if world_size(group) > 1:
        host = dist.get_backend(group) == "gloo"
        device = torch.device("cpu") if host else control_device(group)
        _sync(_logged("barrier", 0, device, lambda: _watched(dist.barrier(group=group, async_op=host), device), group))


def broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int, group: ProcessGroup | None,
                        bucket_bytes: int = 64 * 2**20) -> None:
    """Broadcast many tensors from global rank ``src`` in a few flat messages per dtype and device.

    One message per tensor costs a round trip each (hundreds for a transformer); packing them
    into buckets of ``bucket_bytes`` costs one copy in and one copy out instead.
    """
    _begin("broadcast")
    if world_size(group) == 1:
        return
    receiving = dist.get_rank() != src
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_kind.setdefault((t.dtype, t.device), []).append(t)
    for kind in by_kind.values():
        buckets = consecutive_runs(kind, lambda t: t.numel() * t.element_size(), bucket_bytes)
        for chunk in buckets:
            flat = torch.cat([x.reshape(-1) for x in chunk])
            _collective("broadcast", flat, group, False, partial(_start_broadcast, flat, src, group))
            if receiving:
                for x, piece in zip(chunk, flat.split([x.numel() for x in chunk])):
                    x.copy_(piece.view_as(x))


def _start_broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None, async_op: bool) -> Any:
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def _sync(work: Any) -> None:
    """Wait for a collective that its caller expects done on return."""
    if work is not None:
        work.wait()


def gather_ragged(values: Sequence[int], group: ProcessGroup | None, what: str) -> torch.Tensor:
    """Every rank's list of int64 ``values`` (lengths may differ), as rows ``[world, longest]``
    padded with -1. Two small all-gathers: for diagnosis after a check failed, not a hot path."""
    n, device = world_size(group), control_device(group)
    lengths = torch.empty(n, dtype=torch.int64, device=device)
    all_gather(lengths, torch.tensor([len(values)], dtype=torch.int64, device=device), group, async_op=False,
               what=f"all-gather of {what} lengths")
    mine = torch.full((int(lengths.max()),), -1, dtype=torch.int64, device=device)
    mine[: len(values)] = torch.tensor(list(values), dtype=torch.int64, device=device)
    rows = torch.empty(n, mine.numel(), dtype=torch.int64, device=device)
    all_gather(rows.view(-1), mine, group, async_op=False, what=f"all-gather of {what}")
    return rows


def first_difference(rows: torch.Tensor) -> int | None:
    """The first column where some row differs from row 0 (``None``: all rows equal)."""
    differs = (rows != rows[0]).any(dim=0).nonzero()
    return int(differs[0]) if differs.numel() else None


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def check_same_across_ranks(items: Sequence[str], group: ProcessGroup | None, what: str,
                            hint: str = "Every rank must build the same model, with the same parameter names, "
                                        "shapes and order.") -> None:
    """Raise :class:`DistributedError` naming the first differing item if ranks disagree.

    Used before any bucketed collective: ranks that built different models would otherwise
    hang inside a collective with mismatched sizes.
    """
    _begin(f"the all-gather checking {what}")
    n = world_size(group)
    if n == 1:
        return
    device = control_device(group)
    local = torch.tensor([_digest("\n".join(items))], dtype=torch.int64, device=device)
    gathered = torch.empty(n, dtype=torch.int64, device=device)
    all_gather(gathered, local, group, async_op=False, what=f"the all-gather checking {what}")
    if bool((gathered == gathered[0]).all()):
        return
    # Second round, only on failure: compare item by item to name the first culprit.
    rows = gather_ragged([_digest(item) for item in items], group, what)
    index = first_difference(rows)
    assert index is not None  # the whole lists differ, so some entry does
    bad = [r for r in range(n) if rows[r, index] != rows[0, index]]
    mine = f"{items[index]!r}, {len(items)} entries in all" if index < len(items) else \
        f"no entry there: it has {len(items)} in all"
    raise DistributedError(
        f"{what} differ across ranks at entry {index} (ranks {bad} differ from rank 0; this rank has {mine}). {hint}"
    )
