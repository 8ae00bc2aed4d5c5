"""Failing together: a local error in a collective save or load is raised on every rank.

Without this, one rank raising (a missing file, a full disk) while the others proceed to the next
collective leaves them blocked until the process-group timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from zeroshard.core.comm import collectives as C
from zeroshard.errors import CheckpointError

T = TypeVar("T")


def together(fn: Callable[[], T], group: dist.ProcessGroup | None, what: str) -> T:
    """Run ``fn`` on every rank; if it raised anywhere, raise on every rank.

    The failing rank re-raises its own exception; the others raise :class:`CheckpointError`
    saying ``"<what> failed on rank <r>"``. One small all-gather, which is also a barrier.
    """
    error: Exception | None = None
    result: T | None = None
    try:
        result = fn()
    except Exception as e:  # re-raised below, once every rank knows
        error = e
    world = C.world_size(group)
    device = C.control_device(group)
    flags = torch.empty(world, dtype=torch.int64, device=device)
    mine = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=device)
    C.all_gather(flags, mine, group, async_op=False, what=f"all-gather of failure flags ({what})")
    if error is not None:
        raise error
    failed = [r for r, f in enumerate(flags.tolist()) if f]
    if failed:
        raise CheckpointError(f"{what} failed on rank{'s' if len(failed) > 1 else ''} "
                              f"{', '.join(map(str, failed))} (see that rank's error)")
    return result  # type: ignore[return-value]
