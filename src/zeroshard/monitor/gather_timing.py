"""ZeRO-3 forward gather time for ``wall_clock_breakdown``, measured from outside the stage.

The coordinator gathers a module's units in a forward pre-hook. Two more pre-hooks on the same
modules, one put in front of all others and one after the coordinator's, bracket it, so their
difference is the time the forward spent gathering (and launching prefetches) for that module.
The gathers of the backward pass run inside autograd and are not visible from here: they count
as backward time.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from zeroshard.core.device import synchronize
from zeroshard.monitor.timers import WallClockTimers


def time_forward_gathers(modules: list[torch.nn.Module], timers: WallClockTimers) -> list[RemovableHandle]:
    """Add the bracketing pre-hooks to ``modules`` (those the coordinator hooks) when ``timers``
    is enabled; the time goes to ``timers`` under ``"gather"``. Returns the hook handles."""
    if not timers.enabled:
        return []
    started = [0.0]

    def start(module: torch.nn.Module, args: Any) -> None:
        synchronize(timers.device)
        started[0] = time.perf_counter()

    def stop(module: torch.nn.Module, args: Any) -> None:
        synchronize(timers.device)
        timers.add("gather", time.perf_counter() - started[0])

    handles = []
    for m in modules:
        handles.append(m.register_forward_pre_hook(start, prepend=True))
        handles.append(m.register_forward_pre_hook(stop))
    return handles
