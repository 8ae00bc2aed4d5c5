"""Which :class:`~zeroshard.offload.state_store.StateStore` a residency gets: a table, not branches."""

from __future__ import annotations

from typing import Any

import torch

from zeroshard.offload.policy import OffloadPolicy, Residency, state_device
from zeroshard.offload.state_store import StateStore

__all__ = ["make_state_store", "optimizer_state_device"]


def optimizer_state_device(policy: OffloadPolicy, device: torch.device) -> torch.device:
    """Where master weights (and so the optimizer state torch creates beside them) live in memory."""
    return state_device(policy.optimizer, device)


def make_state_store(master: Any, policy: OffloadPolicy, device: torch.device, rank: int) -> StateStore:
    """The store for ``policy.optimizer``: in memory (device or host) or swapped to files."""
    if policy.optimizer is Residency.FILE:
        from zeroshard.offload.swapped_store import SwappedStateStore

        return SwappedStateStore(master, policy, device, rank)
    return StateStore(master, policy.optimizer, policy.sub_group_size)
