"""One ZeRO-3 unit: parameters gathered and released together by one collective.

A unit is a :class:`~zeroshard.partition.Bucket` (usually one module's direct parameters) whose
compute-dtype shard lives in a slice of the flat parameter-shard buffer. Its states:

- ``SHARDED``: the rank's chunk in the shard buffer is the only copy of the unit's values; every
  parameter's ``.data`` is an empty placeholder (0 elements).
- ``GATHERING``: an all-gather into a transient buffer is in flight (a prefetch).
- ``GATHERED``: every parameter's ``.data`` is a full, contiguous tensor of its own. Changes made
  to it are *not* written back (see ``GatheredParameters(modifier_rank=...)`` for that).

Releasing for training frees the full tensors' *storage* in place (``resize_(0)``, as FSDP2 does)
and keeps the tensors: autograd saves views of the weights for backward (``weight.t()`` of a
linear layer), which would otherwise keep every released unit's memory alive until its backward,
so that releasing after forward saved nothing. The next gather refills the same storage, so
those saved views read the gathered values again in backward. Releasing an explicit gather
(``state_dict()``, ``GatheredParameters``) only drops the references: the caller may keep the
tensors it was given.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch
import torch.distributed as dist

from zeroshard.comm import collectives as C
from zeroshard.partition import Bucket, full_shape, gather_from_rows


class UnitState(enum.Enum):
    """Where a unit's parameter values live right now."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class ParamUnit:
    """Parameters of one unit, with their shard and the gather/release transitions."""

    def __init__(self, bucket: Bucket, shard: torch.Tensor, group: dist.ProcessGroup | None,
                 persistent: bool, name: str) -> None:
        self.bucket = bucket
        self.shard = shard  # [bucket.numel] compute-dtype view into the flat shard buffer
        self.group = group
        self.world = C.world_size(group)
        self.persistent = persistent
        self.name = name
        self.gather_what = f"all-gather of ZeRO-3 unit {name!r}"  # for errors; built once, not per gather
        self.state = UnitState.SHARDED
        self.shapes = [full_shape(p) for p in bucket.params]
        self._pending: tuple[torch.Tensor, dist.Work | None] | None = None
        #: the full tensors of the last gather whose storage was freed in place: refilled (same
        #: storage) by the next gather, for the views autograd saved of them
        self._freed: list[torch.Tensor] | None = None
        #: called before each all-gather to check that every rank gathers this unit (see
        #: :class:`zeroshard.comm.agreement.GatherGuard`); ``None`` when verification is off
        self.verify: Callable[[ParamUnit], None] | None = None

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The unit's parameters, in layout order."""
        return self.bucket.params

    @property
    def numel(self) -> int:
        """Elements of the unit's gathered parameters."""
        return sum(p_layout.numel for p_layout in self.bucket.layouts)

    def launch_gather(self) -> None:
        """Start the all-gather (no-op unless ``SHARDED``)."""
        if self.state is not UnitState.SHARDED:
            return
        if self.verify is not None:
            self.verify(self)
        out = torch.empty(self.world * self.bucket.numel, dtype=self.shard.dtype, device=self.shard.device)
        work = C.all_gather(out, self.shard, self.group, what=self.gather_what)
        self._pending = (out, work)
        self.state = UnitState.GATHERING

    def wait_gather(self) -> None:
        """Finish a gather: full parameter tensors in place of the placeholders."""
        if self.state is UnitState.SHARDED:
            self.launch_gather()
        if self.state is not UnitState.GATHERING:
            return
        assert self._pending is not None
        out, work = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        rows = out.view(self.world, self.bucket.numel)
        freed, self._freed = self._freed, None
        for i, (p, shape, layout, off) in enumerate(zip(self.params, self.shapes, self.bucket.layouts,
                                                        self.bucket.offsets)):
            if freed is not None:
                full = freed[i]
                full.untyped_storage().resize_(full.numel() * full.element_size())
            else:
                full = torch.empty(shape, dtype=self.shard.dtype, device=self.shard.device)
            gather_from_rows(rows[:, off : off + layout.shard_numel], full.view(-1))
            p.data = full
        self.state = UnitState.GATHERED

    def release(self, free_storage: bool = True) -> None:
        """Drop the gathered tensors; the shard remains the only copy. With ``free_storage`` their
        storage is freed in place (views autograd saved of them included) and refilled by the
        next gather; without, only the references are dropped."""
        if self.state is UnitState.GATHERING:
            self.wait_gather()
        if self.state is UnitState.GATHERED:
            full = [p.data for p in self.params]
            for p in self.params:
                p.data = torch.empty(0, dtype=self.shard.dtype, device=self.shard.device)
            if free_storage:
                for t in full:
                    t.untyped_storage().resize_(0)
                self._freed = full
            self.state = UnitState.SHARDED

    def write_back(self, rank: int, master_views: list[torch.Tensor] | None) -> None:
        """Copy the gathered values' local chunk into the shard (and fp32 masters, if given)."""
        assert self.state is UnitState.GATHERED
        for i, (p, layout, off) in enumerate(zip(self.params, self.bucket.layouts, self.bucket.offsets)):
            s, e = layout.local_range(rank)
            values = p.data.reshape(-1)[s:e]
            self.shard[off : off + (e - s)].copy_(values)
            if master_views is not None:
                master_views[i].data.copy_(values)
