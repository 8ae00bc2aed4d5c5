"""fp32 master weights of this rank's shard, and how updated weights reach the module.

All of a rank's master elements live in one flat fp32 buffer, bucket after bucket in the same
order as the gradient shards, so the gradient shard of the step lines up element for element.
Each trained parameter gets an ``nn.Parameter`` *view* of its real (unpadded) elements: those
views are what the torch optimizer sees, so any optimizer works and its state is exactly
``1/N`` of the model (plus at most ``world - 1`` padding elements per parameter, which are never
given to the optimizer).
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.distributed as dist

from zeroshard.comm import collectives as C
from zeroshard.partition import INIT_CHUNK_ATTR, Bucket, consecutive_runs, gather_from_rows


class MasterShard:
    """The rank-local flat fp32 master buffer and its per-parameter views.

    With ``alias_params`` (fp32 training, stages 0–2) there is no separate buffer: each master is a
    view of this rank's chunk *inside the module's own fp32 parameter*, so master weights cost no
    memory, as in the ZeRO formulas for fp32, and stage 0 needs no copy back into the module.
    """

    def __init__(self, buckets: list[Bucket], rank: int, device: torch.device, alias_params: bool = False) -> None:
        self.buckets = buckets
        self.rank = rank
        self.numel = sum(b.numel for b in buckets)
        self.aliased = alias_params
        self.device = device
        self.flat = torch.zeros(0 if alias_params else self.numel, dtype=torch.float32, device=device)
        self.views: dict[torch.nn.Parameter, torch.nn.Parameter] = {}
        #: each parameter's real element range ``[s, e)`` held by this rank
        self.ranges: dict[torch.nn.Parameter, tuple[int, int]] = {}
        #: ``(master, bucket index, column in the bucket's row, real elements)``
        self.slices: list[tuple[torch.nn.Parameter, int, int, int]] = []
        #: per all-gather slot: ``(send, out)`` buffers, alive during :meth:`all_gather_to_params` only
        self._gather_buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: bytes those buffers took in the last update (what ``comm_workspace`` reports)
        self._gather_bytes = 0
        self._gather_groups: tuple[int, list[tuple[list[Bucket], int, int]]] | None = None
        for b in buckets:
            for p, layout, off in zip(b.params, b.layouts, b.offsets):
                s, e = layout.local_range(rank)
                a = b.start + off
                if alias_params:
                    view = p.data.view(-1)[s:e]
                else:
                    view = self.flat[a : a + (e - s)]
                    # Copied from the full-precision values before the module is cast to a 16-bit
                    # dtype; a parameter built under zero.Init brings exactly this chunk along.
                    chunk = getattr(p, INIT_CHUNK_ATTR, None)
                    view.copy_(chunk if chunk is not None else p.detach().reshape(-1)[s:e])
                master = torch.nn.Parameter(view)
                self.views[p] = master
                self.ranges[p] = (s, e)
                self.slices.append((master, b.index, off, e - s))

    def attach_grads(self, grads: list[torch.Tensor], skip: Collection[torch.nn.Parameter] = ()) -> None:
        """Point every master's ``.grad`` at its slice of the fp32 gradient shard (one flat tensor
        per bucket); masters in ``skip`` get none, so the optimizer leaves them (and their state)
        untouched."""
        for master, bucket, off, n in self.slices:
            master.grad = None if master in skip else grads[bucket][off : off + n]

    def detach_grads(self) -> None:
        """Drop the master gradients (they are views of a buffer the gradient sync owns)."""
        for master, *_ in self.slices:
            master.grad = None

    def bytes_held(self) -> int:
        """Bytes of the flat master buffer, padding included."""
        return self.flat.numel() * self.flat.element_size()

    def copy_to_params(self) -> None:
        """Stage 0: each rank owns whole parameters; copy (and cast) masters into the module."""
        if self.aliased:
            return
        for p, master in self.views.items():
            p.data.copy_(master.detach().view_as(p))

    def workspace_bytes(self) -> int:
        """Bytes of the all-gather buffers during the last parameter update (they are freed after
        it: used once per step, kept they would hold up to 1.5x the model between steps)."""
        return self._gather_bytes

    def all_gather_to_params(self, group: dist.ProcessGroup | None, bucket_numel: int,
                             dtype: torch.dtype) -> None:
        """Stages 1–2: gather every rank's updated shard into the full module parameters.

        Consecutive buckets are gathered together up to ``bucket_numel`` full elements, through
        two buffer pairs: the next gather is in flight while the previous one is copied out.
        The pairs are freed when the update is done.
        """
        world = C.world_size(group)
        inflight: list[tuple[list[Bucket], int, torch.Tensor, dist.Work | None]] = []
        for slot, (buckets, a, b) in enumerate(self._groups(bucket_numel)):
            send, out = self._buffers(slot % 2, world, bucket_numel, dtype)
            send = self._pack(buckets, a, b, send[: b - a])
            out = out[: world * (b - a)]
            inflight.append((buckets, a, out, C.all_gather(out, send, group)))
            if len(inflight) > 1:
                self._scatter_gathered(*inflight.pop(0), world)
        while inflight:
            self._scatter_gathered(*inflight.pop(0), world)
        self._gather_bytes = sum(t.numel() * t.element_size() for pair in self._gather_buffers for t in pair)
        self._gather_buffers = []

    def _groups(self, bucket_numel: int) -> list[tuple[list[Bucket], int, int]]:
        """Consecutive buckets gathered by one collective, with their row range ``[a, b)``."""
        if self._gather_groups is None or self._gather_groups[0] != bucket_numel:
            groups = consecutive_runs(self.buckets, lambda bk: bk.full_numel, bucket_numel)
            spans = [(g, g[0].start, g[-1].start + g[-1].numel) for g in groups]
            self._gather_groups = (bucket_numel, spans)
        return self._gather_groups[1]

    def _buffers(self, slot: int, world: int, bucket_numel: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        rows = max(b - a for _g, a, b in self._groups(bucket_numel))
        while len(self._gather_buffers) <= slot:
            self._gather_buffers.append((torch.empty(0), torch.empty(0)))
        send, out = self._gather_buffers[slot]
        if send.dtype != dtype or send.numel() < rows:
            send = torch.empty(rows, dtype=dtype, device=self.device)
            out = torch.empty(world * rows, dtype=dtype, device=self.device)
            self._gather_buffers[slot] = (send, out)
        return send, out

    def _pack(self, buckets: list[Bucket], a: int, b: int, send: torch.Tensor) -> torch.Tensor:
        """This rank's row ``[a, b)`` of the flat layout, in ``send``'s dtype (padding slots are
        left as they are: no rank reads them)."""
        if not self.aliased:  # 16-bit training: cast the fp32 masters
            return send.copy_(self.flat[a:b])
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
