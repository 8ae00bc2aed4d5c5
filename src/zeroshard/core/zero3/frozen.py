"""ZeRO-3's frozen parameters: partitioned like the trained ones, never updated.

A LoRA or adapter fine-tune trains a small part of a large model; the rest (``requires_grad=False``,
outside the optimizer) is the base model, most of the bytes. Stage 3 partitions it as DeepSpeed
does: each rank keeps its chunk of every frozen parameter in the compute dtype (2Ψ_f/N bytes per
rank in 16-bit, where stages 0–2 hold 2Ψ_f), in units of the usual layout, one per module as for
the trained parameters, gathered and released by the same
:class:`~zeroshard.core.zero3.coordinator.ParamCoordinator`. They have no master, no gradient and no
optimizer state, so nothing is reduced for them and nothing refreshes them after a step; a
checkpoint stores each rank's chunk (:mod:`zeroshard.checkpoint.collect`).

Where the chunks live follows ``offload_param`` like the trained shard's: the device, host memory,
or a swap file of their own. A chunk built under ``zero.Init`` is adopted as it is; the module's
full tensors are dropped once copied.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from zeroshard.core import host_memory
from zeroshard.core.offload import OffloadPolicy
from zeroshard.core.offload.param_store import ParamShard, place_shard
from zeroshard.core.offload.policy import Residency, place_of, should_pin, state_device
from zeroshard.core.partition import INIT_CHUNK_ATTR, Bucket, buckets_from_groups
from zeroshard.core.seam import NO_OBSERVER, ParamObserver, the_unit
from zeroshard.core.zero3.param_unit import ParamUnit, UnitState
from zeroshard.core.zero3.units import unit_groups


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
                 persistence_threshold: int, *, observer: ParamObserver = NO_OBSERVER,
                 clock: Callable[[], int] | None = None) -> None:
        self.buckets: list[Bucket] = buckets_from_groups(unit_groups(module, set(params)), world)
        self.dtype = dtype
        #: this rank's elements ``[lo, hi)`` of each frozen parameter's flattened value
        self.ranges = {p: lay.local_range(rank) for b in self.buckets for p, lay in zip(b.params, b.layouts)}
        names = {p: n for n, p in module.named_parameters()}
        #: the swap file the chunks live in (``offload_param: nvme``), else ``None``
        self.file_shard: ParamShard | None = None
        if offload.params is Residency.FILE:
            self.file_shard = place_shard(self.buckets, sum(b.numel for b in self.buckets), offload, dtype, device,
                                          rank, self._initial_row, clock)
        where = state_device(offload.params, device)
        pin = should_pin(offload.param_pin_memory, device) and where.type == "cpu"
        self.units: list[ParamUnit] = []
        for b in self.buckets:
            # In memory, each unit's row is a tensor of its own, adopted or made as its zero.Init
            # chunks are let go: one flat buffer would be whole while every chunk is still held.
            row = None
            if self.file_shard is None:
                row = self._adopted_chunk(b, where, pin)
                if row is None:
                    row = self._initial_row(b)
                    row = row.pin_memory() if pin else row.to(where)
            u = ParamUnit(b, row, group, name=names.get(b.params[0], "?"), device=device, dtype=dtype,
                          swap=self.file_shard.swap if self.file_shard is not None else None,
                          persistent=sum(lay.numel for lay in b.layouts) <= persistence_threshold,
                          frozen=True, observer=observer)
            u.adopt()
            self.units.append(u)
        #: units whose chunks were overwritten (a checkpoint loaded) while they were gathered
        self._stale: set[ParamUnit] = set()

    def _adopted_chunk(self, b: Bucket, where: torch.device, pin: bool) -> torch.Tensor | None:
        """The zero.Init chunk itself, when it is the unit's whole row as the shard keeps it (one
        parameter, no padding on this rank, the dtype and place the shard wants): no copy. Frozen
        layers of large models are mostly of this kind (linear layers without bias, embeddings);
        a copied chunk is freed only with the rest of its 64 MiB ``zero.Init`` slab."""
        chunk = getattr(b.params[0], INIT_CHUNK_ATTR, None) if len(b.params) == 1 else None
        if (chunk is None or pin or chunk.numel() != b.numel or chunk.dtype != self.dtype or chunk.device != where
                or not chunk.is_contiguous()):
            return None
        delattr(b.params[0], INIT_CHUNK_ATTR)
        return torch.Tensor.reshape(chunk, -1)

    def _initial_row(self, b: Bucket) -> torch.Tensor:
        """Bucket ``b``'s row in host memory (padding zero); the zero.Init chunks copied are freed."""
        row = torch.zeros(b.numel, dtype=self.dtype)
        for p, off in zip(b.params, b.offsets):
            lo, hi = self.ranges[p]
            chunk = getattr(p, INIT_CHUNK_ATTR, None)
            values = chunk.reshape(-1)[: hi - lo] if chunk is not None else p.detach().reshape(-1)[lo:hi]
            row[off : off + hi - lo].copy_(values)
            host_memory.drop_file_pages(values)  # a chunk of zero.Init(remote_device="nvme"): back to its file
            if chunk is not None:
                delattr(p, INIT_CHUNK_ATTR)  # its slab is freed once none of its chunks is held
        return row

    def _where(self, p: torch.nn.Parameter) -> tuple[ParamUnit, int, int]:
        unit: ParamUnit = the_unit(p)
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
        stale until the optimizer's next ``publish()`` releases it (:meth:`stale_units`)."""
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
        if self.file_shard is not None:
            return self.file_shard.bytes_held()
        out: dict[str, int] = {}
        for u in self.units:
            assert u.shard is not None
            place = place_of(u.shard)
            out[place] = out.get(place, 0) + u.shard.numel() * u.shard.element_size()
        return out

    def close(self) -> None:
        """Remove the swap file, if any."""
        if self.file_shard is not None:
            self.file_shard.close()
