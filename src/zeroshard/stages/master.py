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
from zeroshard.partition import INIT_CHUNK_ATTR, Bucket, gather_from_rows


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
        self.flat = torch.zeros(0 if alias_params else self.numel, dtype=torch.float32, device=device)
        self.views: dict[torch.nn.Parameter, torch.nn.Parameter] = {}
        #: each parameter's real element range ``[s, e)`` held by this rank
        self.ranges: dict[torch.nn.Parameter, tuple[int, int]] = {}
        self.slices: list[tuple[torch.nn.Parameter, int, int]] = []
        self._slice_of: dict[torch.nn.Parameter, tuple[torch.nn.Parameter, int, int]] = {}
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
                self.slices.append((master, a, e - s))
                self._slice_of[p] = (master, a, e - s)

    def attach_grads(self, flat_grad: torch.Tensor, skip: Collection[torch.nn.Parameter] = ()) -> None:
        """Point every master's ``.grad`` at its slice of an fp32 flat gradient shard; masters in
        ``skip`` get none, so the optimizer leaves them (and their state) untouched."""
        for master, a, n in self.slices:
            master.grad = None if master in skip else flat_grad[a : a + n]

    def detach_grads(self) -> None:
        """Drop the master gradients (they are views of a buffer the gradient sync owns)."""
        for master, _a, _n in self.slices:
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

    def all_gather_to_params(self, group: dist.ProcessGroup | None, bucket_numel: int,
                             dtype: torch.dtype) -> None:
        """Stages 1–2: gather every rank's updated shard into the full module parameters.

        Consecutive buckets are gathered together up to ``bucket_numel`` full elements, and the
        next gather is in flight while the previous one is copied out.
        """
        world = C.world_size(group)
        groups: list[list[Bucket]] = [[]]
        size = 0
        for b in self.buckets:
            if groups[-1] and size + b.full_numel > bucket_numel:
                groups.append([])
                size = 0
            groups[-1].append(b)
            size += b.full_numel
        inflight: list[tuple[list[Bucket], torch.Tensor, dist.Work | None]] = []
        for gb in groups:
            if gb:
                inflight.append(self._launch_gather(gb, group, world, dtype))
            if len(inflight) > 1:
                self._scatter_gathered(*inflight.pop(0), world)
        while inflight:
            self._scatter_gathered(*inflight.pop(0), world)

    def _launch_gather(self, buckets: list[Bucket], group: dist.ProcessGroup | None, world: int,
                       dtype: torch.dtype) -> tuple[list[Bucket], torch.Tensor, dist.Work | None]:
        a = buckets[0].start
        b = buckets[-1].start + buckets[-1].numel
        send = self._pack(buckets, a, b, dtype)
        out = torch.empty(world * (b - a), dtype=dtype, device=self.flat.device)
        return buckets, out, C.all_gather(out, send, group)

    def _pack(self, buckets: list[Bucket], a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's row ``[a, b)`` of the flat layout, in ``dtype``."""
        if not self.aliased:
            return self.flat[a:b].to(dtype)
        send = torch.zeros(b - a, dtype=dtype, device=self.flat.device)
        for bk in buckets:
            for p in bk.params:
                _master, start, n = self._slice_of[p]
                send[start - a : start - a + n] = self.views[p].detach()
        return send

    @staticmethod
    def _scatter_gathered(buckets: list[Bucket], out: torch.Tensor, work: dist.Work | None, world: int) -> None:
        if work is not None:
            work.wait()
        base = buckets[0].start
        rows = out.view(world, -1)
        for bk in buckets:
            for p, layout, off in zip(bk.params, bk.layouts, bk.offsets):
                col = bk.start - base + off
                gather_from_rows(rows[:, col : col + layout.shard_numel], p.data.view(-1))
