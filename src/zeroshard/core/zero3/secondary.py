"""ZeRO++ hpZ: a secondary shard of each gathered unit inside a small group of ranks (a node).

After a unit's forward all-gather over the whole world, each rank keeps ``1/h`` of the unit's
gathered values, where ``h`` is ``zero_hpz_partition_size`` (the ranks of a node, or a divisor of
them). A later gather of the unit in the same pass (its backward, when the live budget released it
after forward) all-gathers these secondary shards over the ``h`` ranks only, so it never crosses
the link between nodes. The price is memory: ``Ψ/h`` compute-dtype elements per rank while the
secondaries live, against the primary shard's ``Ψ/N``.

Layout: the world's gathered unit is ``[N, n]`` (a row per rank, :mod:`~zeroshard.core.partition.layout`);
the rank with index ``j`` in its hpZ group keeps rows ``[j·N/h, (j+1)·N/h)``, so the group's
all-gather lays the rows back in order.

Validity: a secondary is a copy of values the step is about to change, so every secondary is
dropped at the end of each backward (the next forward gathers over the world again, as
DeepSpeed's does) and whenever the unit's shard is written (a step, a write-back, a checkpoint
load). A pass that never reaches backward (evaluation, ``torch.no_grad``) keeps none.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["SecondaryShards"]


class SecondaryShards:
    """The hpZ group of this rank and the bytes its units' secondary shards hold."""

    def __init__(self, group: dist.ProcessGroup, size: int, index: int, world: int) -> None:
        if size < 2 or world % size:
            raise ValueError(f"an hpZ group of {size} ranks does not divide {world} ranks")
        #: the ``size`` consecutive ranks this rank's secondary gathers run over
        self.group = group
        self.size = size
        #: this rank's index in :attr:`group`
        self.index = index
        #: rows of the world's ``[N, n]`` gathered unit each rank keeps
        self.rows = world // size
        self.bytes = 0
        self.peak_bytes = 0

    def keep(self, gathered: torch.Tensor) -> torch.Tensor:
        """This rank's secondary shard of a unit gathered as ``[N, n]`` rows: a copy."""
        a = self.index * self.rows
        secondary = gathered[a : a + self.rows].clone()
        self.bytes += secondary.numel() * secondary.element_size()
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        return secondary

    def dropped(self, secondary: torch.Tensor) -> None:
        """Account for a secondary shard let go."""
        self.bytes -= secondary.numel() * secondary.element_size()
