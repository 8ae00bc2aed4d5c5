"""ZeRO-3's frozen parameters: partitioned like the trained ones, never updated.

A LoRA or adapter fine-tune trains a small part of a large model; the rest (``requires_grad=False``,
outside the optimizer) is the base model, most of the bytes. Stage 3 partitions it as DeepSpeed
does: each rank keeps its chunk of every frozen parameter in the compute dtype (2Ψ_f/N bytes per
rank in 16-bit, where stages 0–2 hold 2Ψ_f), in units of the usual layout, one per module as for
the trained parameters, gathered and released by the same
:class:`~zeroshard.stages.coordinator.ParamCoordinator`. They have no master, no gradient and no
optimizer state, so nothing is reduced for them and nothing refreshes them after a step; a
checkpoint stores each rank's chunk (:mod:`zeroshard.checkpoint.collect`).

Where the chunks live follows ``offload_param`` like the trained shard's: the device, host memory,
or a swap file of their own. A chunk built under ``zero.Init`` is adopted as it is; the module's
full tensors are dropped once copied.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zeroshard.offload import OffloadPolicy
from zeroshard.offload.param_store import ParamShard, place_shard
from zeroshard.partition import INIT_CHUNK_ATTR, Bucket, buckets_from_groups
from zeroshard.stages.param_unit import ParamUnit, UnitState
from zeroshard.stages.units import unit_groups


def frozen_to_partition(module: torch.nn.Module, trained: set[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The parameters stage 3 partitions without training: outside the optimizer and not requiring
    gradients. One outside the optimizer that requires them would get a full ``.grad`` from
    autograd in backward, which a released unit cannot take: it stays whole."""
    return [p for p in dict.fromkeys(module.parameters()) if p not in trained and not p.requires_grad]


class FrozenShard:
    """This rank's chunks of the frozen parameters, and their units.

    Args:
        module: the model (units follow its modules, as the trained ones do).
        params: the parameters to partition (:func:`frozen_to_partition`).
        group, rank: the data-parallel group and this rank in it.
        dtype: the compute dtype the chunks are kept in.
        device: the training device (where units are gathered).
        offload: where the chunks live (``offload_param``).
        persistence_threshold: units of at most this many elements stay gathered.
    """

    def __init__(self, module: torch.nn.Module, params: list[torch.nn.Parameter], group: dist.ProcessGroup | None,
                 rank: int, world: int, dtype: torch.dtype, device: torch.device, offload: OffloadPolicy,
                 persistence_threshold: int) -> None:
        self.buckets: list[Bucket] = buckets_from_groups(unit_groups(module, set(params)), world)
        self.dtype = dtype
        #: this rank's elements ``[lo, hi)`` of each frozen parameter's flattened value
        self.ranges = {p: lay.local_range(rank) for b in self.buckets for p, lay in zip(b.params, b.layouts)}
        self.shard: ParamShard = place_shard(self.buckets, sum(b.numel for b in self.buckets), offload, dtype,
                                             device, rank, self._initial_row)
        names = {p: n for n, p in module.named_parameters()}
        self.units = [ParamUnit(b, self.shard.unit_view(b), group, name=names.get(b.params[0], "?"), device=device,
                                swap=self.shard.swap, dtype=dtype,
                                persistent=sum(lay.numel for lay in b.layouts) <= persistence_threshold)
                      for b in self.buckets]
        for u in self.units:
            u.adopt()
        #: units whose chunks were overwritten (a checkpoint loaded) while they were gathered
        self._stale: set[ParamUnit] = set()

    def _initial_row(self, b: Bucket) -> torch.Tensor:
        row = torch.zeros(b.numel, dtype=self.dtype)
        for p, off in zip(b.params, b.offsets):
            lo, hi = self.ranges[p]
            chunk = getattr(p, INIT_CHUNK_ATTR, None)
            values = chunk.reshape(-1)[: hi - lo] if chunk is not None else p.detach().reshape(-1)[lo:hi]
            row[off : off + hi - lo].copy_(values)
        return row

    def _where(self, p: torch.nn.Parameter) -> tuple[ParamUnit, int, int]:
        unit: ParamUnit = p._zeroshard_unit  # type: ignore[attr-defined]
        lo, hi = self.ranges[p]
        return unit, unit.bucket.offsets[unit.position(p)], hi - lo

    def read(self, p: torch.nn.Parameter) -> torch.Tensor:
        """This rank's elements of ``p`` (a copy when they live in a file)."""
        unit, off, n = self._where(p)
        row = unit._read_row() if unit.swap is not None else unit.shard
        assert row is not None
        return row[off : off + n]

    def write(self, p: torch.nn.Parameter, values: torch.Tensor) -> None:
        """Overwrite this rank's elements of ``p`` (cast to the compute dtype); a gathered copy is
        stale until :meth:`refresh`."""
        unit, off, n = self._where(p)
        if values.numel() != n:
            raise ValueError(f"frozen parameter {unit.name!r}: {values.numel()} values for {n} elements")
        unit.write_shard(off, values.reshape(-1))
        if unit.state is not UnitState.SHARDED:
            self._stale.add(unit)

    def stale_units(self) -> list[ParamUnit]:
        """Units gathered before their chunks were overwritten (to release), forgotten once returned."""
        stale, self._stale = list(self._stale), set()
        return stale

    def bytes_held(self) -> dict[str, int]:
        """Bytes of the chunks by place (``device``, ``host``, ``pinned_host``, ``file``)."""
        return self.shard.bytes_held()

    def close(self) -> None:
        """Remove the swap file, if any."""
        self.shard.close()

