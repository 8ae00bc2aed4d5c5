"""fp32 ZeRO-3 in host memory: while a unit is gathered for training, its row lives there only.

With fp32 compute and the masters in host memory, a unit's row of the fp32 master shard is also
the parameter shard it is gathered from, and the gathered unit holds an exact copy of that row in
its full tensors. The default live budget (``stage3_max_live_parameters``: 1e9, DeepSpeed's)
keeps a model of up to a billion parameters gathered from its forward to the end of its
backward, so each rank would hold its own chunk twice over the whole pass: 4Ψ/N bytes, 222 MiB
per rank for a 116M-parameter model on 2 ranks (``docs/performance.md``). FSDP2 does not pay
it at its defaults because it re-shards after each block's forward.

While a unit is gathered for training (by a forward with gradients enabled, whose backward ends
by releasing it; units an evaluation forward gathers can stay gathered until the next step, and
are not lent), the pages of its row are handed back to the system. A unit prefetched for training
lends its row as its all-gather starts when that gather has copied the row into its output (the
CPU ring does): the default prefetch starts every unit's gather in the first module, and lent only
when each unit's forward waited for it, the rows and the landed gathers were held together. The
row is rewritten from the gathered tensors (from the gather's output while it is in flight)
before the unit is released, before an explicit gather (``state_dict()``,
``GatheredParameters``) hands them out, and before anything reads or writes the masters (the
state store calls :meth:`RowLender.reclaim_all` at each of its entry points: the step,
checkpoints, ``safe_get_*``/``safe_set_*``). The cost is one copy of the row per release (1/N of
what the gather itself copies) into pages the kernel must fault in and zero again: 3-4% of a CPU
step on the benchmark's GPTs. Stage 3 lends only when the live budget holds every released unit.

A parameter changed in place while gathered for training (a change that is never written back)
would put this rank's chunk of the change into its master and no other rank's: that is an error
naming the parameter, not a silent divergence. ``ZEROSHARD_HOST_MAPPED=0`` turns lending off
(with zeroshard's other host mappings, :mod:`zeroshard.core.host_memory`). Nothing of this applies on
an accelerator (one allocation cannot return part of its memory), in 16-bit training (the
gathered values are a cast of the masters) or with the masters in swap files.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from zeroshard.errors import ZeroshardError

if TYPE_CHECKING:
    from zeroshard.core.zero3.param_unit import ParamUnit


class RowLender:
    """Lends gathered units' rows of a droppable master buffer to their gathered parameters.

    Args:
        drop: ``drop(start, end)`` hands flat elements ``[start, end)`` of the shard back to the
            system and returns the bytes it freed (:meth:`MasterShard.drop_pages`).
        rank: this rank (which chunk of each parameter its row holds).
        names: the parameters' names in the module, for errors.
    """

    def __init__(self, drop: Callable[[int, int], int], rank: int, names: dict[torch.nn.Parameter, str]) -> None:
        self._drop = drop
        self.rank = rank
        self.names = names
        #: the units lent now: the bytes handed back, and each parameter's version counter when lent
        self.lent: dict[ParamUnit, tuple[int, list[int]]] = {}
        #: bytes handed back now, and at most
        self.lent_bytes = 0
        self.peak_lent_bytes = 0

    def lend(self, u: ParamUnit) -> None:
        """``u`` was just gathered for training (its row is in its full tensors), or its gather was
        prefetched for training and has already copied the row into its output: drop the shard's."""
        if u in self.lent:  # lent while its gather was in flight: the tensors it now has are new
            self.lent[u] = (self.lent[u][0], [p._version for p in u.params])
            return
        freed = self._drop(u.bucket.start, u.bucket.start + u.bucket.numel)
        if not freed:
            return  # smaller than a page: nothing to gain, nothing to rewrite
        self.lent[u] = (freed, [p._version for p in u.params])
        self.lent_bytes += freed
        self.peak_lent_bytes = max(self.peak_lent_bytes, self.lent_bytes)

    def holds(self, u: ParamUnit) -> bool:
        """Whether ``u``'s row is lent now."""
        return u in self.lent

    def reclaim(self, u: ParamUnit) -> None:
        """Rewrite ``u``'s row of the shard from its gathered tensors (no-op unless lent)."""
        entry = self.lent.pop(u, None)
        if entry is None:
            return
        freed, versions = entry
        self.lent_bytes -= freed
        shard = u.shard
        assert shard is not None
        if u.in_flight:  # lent while its gather is in flight: the row is in the gather's output
            with torch.no_grad():
                shard.copy_(u.own_row(self.rank))
            return
        self._check_unmodified(u, versions)
        with torch.no_grad():
            for p, layout, off in zip(u.params, u.bucket.layouts, u.bucket.offsets):
                s, e = layout.local_range(self.rank)
                shard[off : off + (e - s)].copy_(p.data.reshape(-1)[s:e])

    def check_unmodified(self, u: ParamUnit) -> None:
        """Raise if a parameter of ``u`` was changed in place since its row was lent (a unit kept
        gathered into the next micro-step is checked at the end of each backward, not only when
        released)."""
        entry = self.lent.get(u)
        if entry is not None:
            self._check_unmodified(u, entry[1])

    def _check_unmodified(self, u: ParamUnit, versions: list[int]) -> None:
        for p, version in zip(u.params, versions):
            if p._version != version:
                raise ZeroshardError(
                    f"ZeRO-3 parameter {self.names.get(p, u.name)!r} was modified in place while gathered for "
                    "training; such changes are not written back (use GatheredParameters(params, "
                    "modifier_rank=...) outside forward), and in fp32 on the CPU this rank's chunk of its shard "
                    "lives in the gathered tensor meanwhile, so its value is lost. Set ZEROSHARD_HOST_MAPPED=0 "
                    "to keep a separate copy of the shard while gathered")

    def reclaim_all(self) -> None:
        """Rewrite every lent row (before the masters are read or written)."""
        for u in list(self.lent):
            self.reclaim(u)
