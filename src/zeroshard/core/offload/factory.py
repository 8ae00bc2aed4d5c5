"""Which :class:`~zeroshard.core.offload.state_store.StateStore` a residency gets: a table, not branches."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from zeroshard.core.offload.policy import OffloadPolicy, Residency, state_device
from zeroshard.core.offload.state_store import SplitStateStore, StateStore

if TYPE_CHECKING:
    from zeroshard.core.master import MasterShard

__all__ = ["make_state_store", "optimizer_state_device"]


def optimizer_state_device(policy: OffloadPolicy, device: torch.device) -> torch.device:
    """Where master weights (and so the optimizer state torch creates beside them) live in memory."""
    return state_device(policy.optimizer, device)


def make_state_store(master: MasterShard, policy: OffloadPolicy, device: torch.device, rank: int,
                     publish: Callable[[int, int, torch.Tensor], None] | None = None,
                     before_access: Callable[[], None] | None = None,
                     residencies: tuple[Residency, ...] | None = None) -> StateStore:
    """The store for ``policy.optimizer``: in memory (device or host), split between the two
    (partial offload: each sub-group where ``residencies`` says, ``master`` split accordingly), or
    swapped to files (``publish`` and ``before_access``: see :class:`StateStore`)."""
    if policy.partial:
        if residencies is None:
            raise ValueError("partial optimizer offload needs each sub-group's residency")
        return SplitStateStore(master, residencies, device, policy.sub_group, publish, before_access)
    if policy.optimizer is Residency.FILE:
        from zeroshard.core.offload.swapped_store import SwappedStateStore

        return SwappedStateStore(master, policy, device, rank, publish, before_access)
    return StateStore(master, policy.optimizer, policy.sub_group, publish, before_access)
