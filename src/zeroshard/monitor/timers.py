"""Wall-clock timers for ``wall_clock_breakdown``: forward, backward, reduction, step and gather durations.

Disabled timers cost one attribute check. Enabled ones synchronise the device around each
measured region (as DeepSpeed's do) so that accelerator time is attributed to the right phase.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from zeroshard.core.device import synchronize


class WallClockTimers:
    """Accumulates named durations between reports."""

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled = enabled
        self.device = device
        self.totals: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """Time the enclosed block under ``name`` (no-op when disabled)."""
        if not self.enabled:
            yield
            return
        synchronize(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.totals[name] += time.perf_counter() - t0
            self.counts[name] += 1

    def add(self, name: str, seconds: float) -> None:
        """Count a duration measured elsewhere (hooks that cannot use the context manager)."""
        self.totals[name] += seconds
        self.counts[name] += 1

    def summary(self) -> str:
        """`` forward=12.3ms backward=...`` (mean per call), or ``""`` when disabled."""
        if not self.enabled:
            return ""
        parts = [f"{k}={1000 * self.totals[k] / max(self.counts[k], 1):.1f}ms" for k in sorted(self.totals)]
        return " " + " ".join(parts)

    def reset(self) -> None:
        """Start a new reporting window."""
        self.totals.clear()
        self.counts.clear()
