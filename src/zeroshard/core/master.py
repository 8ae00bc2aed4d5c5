"""fp32 master weights of this rank's shard, and how updated weights reach the module.

All of a rank's master elements live in one flat fp32 buffer, bucket after bucket in the same
order as the gradient shards, so the gradient shard of the step lines up element for element.
Each trained parameter gets an ``nn.Parameter`` *view* of its real (unpadded) elements: those
views are what the torch optimizer sees, so any optimizer works and its state is exactly
``1/N`` of the model (plus at most ``world - 1`` padding elements per parameter, which are never
given to the optimizer).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zeroshard.core import host_memory
from zeroshard.core.comm import collectives as C
from zeroshard.core.partition import (
    COMM_BUFFERS,
    INIT_CHUNK_ATTR,
    Bucket,
    buffer_numel,
    consecutive_runs,
    gather_from_rows,
)


def swapped_placeholder(numel: int) -> torch.Tensor:
    """What a swapped-out master holds: the right shape, one element of memory, and NaN, so that a
    read that bypasses the state store shows at once (a ``meta`` tensor cannot be swapped for host
    memory through ``.data``)."""
    return torch.full((1,), float("nan"), dtype=torch.float32).expand(numel)


@dataclass(frozen=True)
class KeptPrefix:
    """Partial optimizer offload: the masters of the leading flat elements ``[0, end)`` (whole
    sub-groups) stay on ``device``, the training device; the rest are in host memory."""

    end: int
    device: torch.device


class MasterShard:
    """The rank-local flat fp32 master buffer and its per-parameter views.

    With ``alias_params`` (fp32 training, stages 0–2) there is no separate buffer: each master is a
    view of this rank's chunk *inside the module's own fp32 parameter*, so master weights cost no
    memory, as in the ZeRO formulas for fp32, and stage 0 needs no copy back into the module.

    ``device`` is where the flat buffer lives: the training device, or the host with optimizer
    offload. With ``swapped`` (NVMe optimizer offload) there is no buffer either: the views are
    placeholders (:func:`swapped_placeholder`) until the swapped store points them at a sub-group
    buffer for the step; the initial values are taken from :meth:`initial_values` by the store,
    which writes them to its files. With ``kept`` (partial optimizer offload, stage 3) the buffer is
    two, in layout order: the leading sub-groups' masters on the training device, the rest on
    ``device`` (host memory); :meth:`span` reads a range from either.
    """

    def __init__(self, buckets: list[Bucket], rank: int, device: torch.device, alias_params: bool = False,
                 swapped: bool = False, pin: bool = False, droppable: bool = False,
                 comm_device: torch.device | None = None, pack_dtype: torch.dtype | None = None,
                 kept: KeptPrefix | None = None) -> None:
        self.buckets = buckets
        self.rank = rank
        self.numel = sum(b.numel for b in buckets)
        self.aliased = alias_params
        self.device = device
        #: where the stage 1-2 all-gather buffers live: the training device, also when the masters
        #: are in host memory (NCCL gathers device tensors only)
        self.comm_device = comm_device if comm_device is not None else device
        self.swapped = swapped and not alias_params
        if kept is not None and (alias_params or self.swapped or droppable or pack_dtype is not None):
            raise ValueError("masters split between the device and host memory (partial optimizer offload) are "
                             "buffers of their own: not aliased, swapped, droppable or packed from a copy")
        #: partial optimizer offload: the leading elements that stay on the training device (``None``: all
        #: of the buffer is on ``device``)
        self.kept = kept
        # Page-locked with CPU optimizer offload on an accelerator: updated masters then reach the
        # device by asynchronous copies that overlap the step of the next sub-group.
        numel = 0 if alias_params or self.swapped else self.numel
        #: with ``droppable`` (a large buffer in host memory, not page-locked), the mapping the flat
        #: buffer lives in, so that :meth:`drop_pages` can hand ranges of it back to the system
        self._flat_map: host_memory.MappedBuffer | None = None
        pinned = pin and device.type == "cpu"
        if kept is not None:
            # Two buffers, in layout order: [0, kept.end) on the training device, the rest on ``device``.
            self.segments: tuple[torch.Tensor, ...] = (
                torch.zeros(kept.end, dtype=torch.float32, device=kept.device),
                torch.zeros(numel - kept.end, dtype=torch.float32, device=device, pin_memory=pinned))
            self._starts: tuple[int, ...] = (0, kept.end)
        elif droppable and not pin and host_memory.mappable(device, numel * 4, min_bytes=1):
            self._flat_map = host_memory.MappedBuffer(numel * 4)  # zero-filled, as torch.zeros
            self.segments, self._starts = (self._flat_map.tensor(torch.float32),), (0,)
        else:
            self.segments = (torch.zeros(numel, dtype=torch.float32, device=device, pin_memory=pinned),)
            self._starts = (0,)
        #: stages 1-2 with the masters in swap files (``pack_dtype``): a compute-dtype shard on the
        #: communication device that the swapped store keeps current (``None``: they pack from the masters)
        self._compute_copy: torch.Tensor | None = None
        self.views: dict[torch.nn.Parameter, torch.nn.Parameter] = {}
        #: each parameter's real element range ``[s, e)`` held by this rank
        self.ranges: dict[torch.nn.Parameter, tuple[int, int]] = {}
        #: ``(master, bucket index, column in the bucket's row, real elements)``
        self.slices: list[tuple[torch.nn.Parameter, int, int, int]] = []
        #: per all-gather slot: ``(send, out)`` buffers, alive during :meth:`all_gather_to_params` only
        self._gather_buffers: list[torch.Tensor] = []
        #: bytes those buffers took in the last update (what ``comm_workspace`` reports)
        self._gather_bytes = 0
        self._gather_groups: tuple[tuple[int, tuple[int, ...]], list[tuple[list[Bucket], int, int]]] | None = None
        #: the all-gather under way (:meth:`begin_all_gather`), or ``None``
        self._gather: _Gather | None = None
        for b in buckets:
            for p, layout, off in zip(b.params, b.layouts, b.offsets):
                s, e = layout.local_range(rank)
                a = b.start + off
                if alias_params:
                    view = p.data.view(-1)[s:e]
                elif self.swapped:
                    view = swapped_placeholder(e - s)
                else:
                    view = self.span(a, a + (e - s))
                self.ranges[p] = (s, e)
                if not alias_params and not self.swapped:
                    # Copied from the full-precision values before the module is cast to a 16-bit
                    # dtype; a parameter built under zero.Init brings exactly this chunk along.
                    self.copy_initial(p, view)
                master = torch.nn.Parameter(view)
                self.views[p] = master
                self.slices.append((master, b.index, off, e - s))
        if pack_dtype is not None and self.swapped:
            self._compute_copy = self.initial_flat(pack_dtype, self.comm_device)

    @property
    def flat(self) -> torch.Tensor:
        """The flat master buffer, the whole layout in one tensor (empty when aliased or swapped).

        Raises:
            RuntimeError: the masters are split between the device and host memory (:attr:`kept`):
                read them by ranges (:meth:`span`) or buffers (:attr:`segments`).
        """
        if len(self.segments) != 1:
            raise RuntimeError("the master shard is split between the device and host memory (partial optimizer "
                               "offload): it has no single flat buffer; use span() or segments")
        return self.segments[0]

    def span(self, start: int, end: int) -> torch.Tensor:
        """The masters of flat elements ``[start, end)``, a view (a range never crosses from the
        device's part into host memory: the split is at a sub-group's start)."""
        for first, buf in zip(reversed(self._starts), reversed(self.segments)):
            if start >= first:
                if end - first > buf.numel():
                    raise ValueError(f"flat range [{start}, {end}) crosses the split of the master shard at {first}")
                return buf[start - first : end - first]
        raise ValueError(f"flat range [{start}, {end}) is outside the master shard")

    @property
    def pack_source(self) -> torch.Tensor:
        """The flat source of the compute-dtype parameters published after a step (stages 1-2 pack
        their all-gathers from it): the masters, or, with the masters in swap files, the
        compute-dtype shard on the communication device that the swapped store keeps current."""
        return self._compute_copy if self._compute_copy is not None else self.flat

    @property
    def compute_copy(self) -> bool:
        """Whether :attr:`pack_source` is a compute-dtype copy of its own (stages 1-2, masters in files)."""
        return self._compute_copy is not None

    def initial_values(self, p: torch.nn.Parameter) -> torch.Tensor:
        """This rank's chunk of ``p`` as it was before training (the ``zero.Init`` chunk, or a
        slice of the module's fp32 value)."""
        s, e = self.ranges[p]
        chunk = getattr(p, INIT_CHUNK_ATTR, None)
        return chunk if chunk is not None else p.detach().reshape(-1)[s:e]

    def copy_initial(self, p: torch.nn.Parameter, into: torch.Tensor) -> None:
        """Copy ``p``'s initial values into ``into``; a ``zero.Init`` chunk in a file-backed
        buffer (``remote_device="nvme"``) then leaves the process's memory again."""
        values = self.initial_values(p)
        into.copy_(values)
        host_memory.drop_file_pages(values)

    def initial_flat(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor of the layout holding the initial values in ``dtype`` (padding zero): the
        compute-dtype parameter shard when the masters themselves are swapped out."""
        out = torch.zeros(self.numel, dtype=dtype, device=device)
        for p, (_master, bucket, off, n) in zip(self.views, self.slices):
            a = self.buckets[bucket].start + off
            self.copy_initial(p, out[a : a + n])
        return out

    def attach_grads(self, grads: list[torch.Tensor], skip: Collection[torch.nn.Parameter] = (),
                     slices: Sequence[tuple[torch.nn.Parameter, int, int, int]] | None = None) -> None:
        """Point the masters' ``.grad`` at their slices of the fp32 gradient shard (one flat tensor
        per bucket); masters in ``skip`` get none, so the optimizer leaves them (and their state)
        untouched. ``slices``: only these masters (one sub-group), the others get none either.
        A gradient on another device than its master is copied over (CPU optimizer offload: to the
        host; partial offload, the device's sub-groups: from the host shard to the device), the
        copies asynchronous and waited for before returning."""
        to_device = False
        for master, bucket, off, n in self.slices if slices is None else slices:
            if master in skip:
                master.grad = None
                continue
            g = grads[bucket][off : off + n]
            master.grad = g if g.device == master.device else g.to(master.device, non_blocking=True)
            to_device |= master.device.type == "cuda" and g.device.type == "cpu"
        if slices is not None and (to_device or any(g.device.type == "cuda" for g in grads)):
            # Copies to the host must land before the CPU steps; copies to the device before the host
            # shard they read is zeroed after the step (the CPU does not wait for the stream there).
            torch.cuda.current_stream().synchronize()

    def detach_grads(self, slices: Sequence[tuple[torch.nn.Parameter, int, int, int]] | None = None) -> None:
        """Drop the master gradients (they are views of a buffer the gradient sync owns)."""
        for master, *_ in self.slices if slices is None else slices:
            master.grad = None

    @property
    def droppable(self) -> bool:
        """Whether :meth:`drop_pages` can free memory (the flat buffer has a mapping of its own)."""
        return self._flat_map is not None

    def adopt_mapping(self, mapping: host_memory.MappedBuffer | None) -> None:
        """:attr:`flat` was moved (:mod:`zeroshard.core.state_moves`) into ``mapping`` (``None``: an
        allocation whose pages cannot be dropped): :meth:`drop_pages` drops from it from now on."""
        self._flat_map = mapping

    def drop_pages(self, start: int, end: int) -> int:
        """Hand the memory of flat elements ``[start, end)`` back to the system: the pages wholly
        inside the range read as zero until written again (a page shared with elements outside it
        is kept). The caller must rewrite every element of the range before anything reads it.
        Returns the bytes dropped."""
        if self._flat_map is None:
            return 0
        return self._flat_map.drop(start * 4, (end - start) * 4)

    def bytes_held(self) -> int:
        """Bytes of the flat master buffer (both parts when split), padding included."""
        return sum(t.numel() * t.element_size() for t in self.segments)

    def copy_to_params(self) -> None:
        """One rank (stage 0, or any stage on one rank) owns whole parameters: copy (and cast) the
        masters, or their published copy, into the module."""
        if self.aliased:
            return
        for p, (_master, bucket, off, n) in zip(self.views, self.slices):
            a = self.buckets[bucket].start + off
            p.data.copy_(self.pack_source[a : a + n].view_as(p))

    def workspace_bytes(self) -> int:
        """Bytes of the all-gather buffers during the last parameter update (they are freed after
        it: used once per step, kept they would hold up to 1.5x the model between steps)."""
        return self._gather_bytes

    def all_gather_to_params(self, group: dist.ProcessGroup | None, bucket_numel: int,
                             dtype: torch.dtype) -> None:
        """Stages 1–2: gather every rank's updated shard into the full module parameters.

        Consecutive buckets are gathered together up to half of ``bucket_numel`` full elements,
        through two buffers: the next gather is in flight while the previous one is copied
        out, and together they receive about ``bucket_numel`` elements (``allgather_bucket_size``:
        "elements all-gathered at a time"). They are freed when the update is done.
        """
        self.begin_all_gather(group, bucket_numel, dtype)
        self.end_all_gather()

    def begin_all_gather(self, group: dist.ProcessGroup | None, bucket_numel: int, dtype: torch.dtype,
                         cuts: Sequence[int] = ()) -> None:
        """Start an all-gather of the updated shard that :meth:`all_gather_through` advances as the
        step finishes ranges of it, so that each range's collective runs while the next is being
        stepped (and its optimizer state read from swap files). No gather spans a position in
        ``cuts`` (the ends of the optimizer's sub-groups: a range is final only there)."""
        groups = self._groups(buffer_numel(bucket_numel), tuple(sorted(cuts)))
        rows = max((b - a for _g, a, b in groups), default=0)
        self._gather = _Gather(group, C.world_size(group), dtype, groups, rows)

    def all_gather_through(self, end: int) -> None:
        """Launch the gathers of every group that ends at or before flat position ``end`` (every
        rank has stepped its row of them), copying out the oldest when both buffers are taken."""
        g = self._gather
        assert g is not None, "all_gather_through() outside begin_all_gather() / end_all_gather()"
        while g.next < len(g.groups) and g.groups[g.next][2] <= end:
            buckets, a, b = g.groups[g.next]
            out = self._buffer(g.next % COMM_BUFFERS, g.world * g.rows, g.dtype)[: g.world * (b - a)]
            # This rank's row is packed where the gather puts it: the all-gather runs in place.
            send = self._pack(buckets, a, b, out.view(g.world, b - a)[self.rank])
            g.inflight.append((buckets, a, out, C.all_gather(out, send, g.group)))
            g.next += 1
            if len(g.inflight) >= COMM_BUFFERS:  # the oldest buffer is the next one to fill
                self._scatter_gathered(*g.inflight.pop(0), g.world)

    def end_all_gather(self) -> None:
        """Gather what is left, copy every gathered group into the parameters, free the buffers."""
        g = self._gather
        assert g is not None, "end_all_gather() without begin_all_gather()"
        self.all_gather_through(self.numel)
        while g.inflight:
            self._scatter_gathered(*g.inflight.pop(0), g.world)
        self._gather = None
        self._gather_bytes = sum(t.numel() * t.element_size() for t in self._gather_buffers)
        self._gather_buffers = []

    def _groups(self, bucket_numel: int, cuts: tuple[int, ...] = ()) -> list[tuple[list[Bucket], int, int]]:
        """Consecutive buckets gathered by one collective, with their row range ``[a, b)``; none
        crosses a flat position in ``cuts``."""
        key = (bucket_numel, cuts)
        if self._gather_groups is None or self._gather_groups[0] != key:
            segments: list[list[Bucket]] = []
            starts = set(cuts)
            for bk in self.buckets:
                if not segments or bk.start in starts:
                    segments.append([])
                segments[-1].append(bk)
            groups = [g for seg in segments for g in consecutive_runs(seg, lambda bk: bk.full_numel, bucket_numel)]
            spans = [(g, g[0].start, g[-1].start + g[-1].numel) for g in groups]
            self._gather_groups = (key, spans)
        return self._gather_groups[1]

    def _buffer(self, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """All-gather buffer ``slot``, of at least ``numel`` elements (every rank's rows of the
        largest group)."""
        while len(self._gather_buffers) <= slot:
            self._gather_buffers.append(torch.empty(0))
        out = self._gather_buffers[slot]
        if out.dtype != dtype or out.numel() < numel:
            # Freed after each publish: on CPU, outside the heap (see host_memory).
            out = self._gather_buffers[slot] = host_memory.empty(numel, dtype, self.comm_device)
        return out

    def _pack(self, buckets: list[Bucket], a: int, b: int, send: torch.Tensor) -> torch.Tensor:
        """This rank's row ``[a, b)`` of the flat layout, in ``send``'s dtype (padding slots are
        left as they are: no rank reads them)."""
        if not self.aliased:  # 16-bit training: cast the fp32 masters (or their published copy)
            return send.copy_(self.pack_source[a:b])
        for bk in buckets:
            for p, off in zip(bk.params, bk.offsets):
                view = self.views[p].detach()
                start = bk.start + off - a
                send[start : start + view.numel()].copy_(view)
        return send

    def _scatter_gathered(self, buckets: list[Bucket], base: int, out: torch.Tensor, work: dist.Work | None,
                          world: int) -> None:
        if work is not None:
            work.wait()
        rows = out.view(world, -1)
        # Aliased masters are the parameters' own chunks: that row is already in place.
        skip = self.rank if self.aliased else None
        for bk in buckets:
            for p, layout, off in zip(bk.params, bk.layouts, bk.offsets):
                col = bk.start - base + off
                gather_from_rows(rows[:, col : col + layout.shard_numel], p.data.view(-1), skip_row=skip)


@dataclass
class _Gather:
    """An all-gather of the updated shard under way (see :meth:`MasterShard.begin_all_gather`)."""

    group: dist.ProcessGroup | None
    world: int
    dtype: torch.dtype
    #: the groups to gather, in order (:meth:`MasterShard._groups`)
    groups: list[tuple[list[Bucket], int, int]]
    #: row elements of the largest group (what each buffer must hold per rank)
    rows: int
    #: index of the next group to launch
    next: int = 0
    inflight: list[tuple[list[Bucket], int, torch.Tensor, dist.Work | None]] = field(default_factory=list)
