"""The DeepSpeed-style training step (``engine(x, y)``, ``backward``, ``step`` per micro-batch).

Shared by zeroshard and DeepSpeed: the very same loop runs on both engines.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from benchmarks.harness.systems.base import Phases
from benchmarks.harness.workload import MicroBatch, timed_census


class EngineLoop:
    """Drives a DeepSpeed-API engine; ``breakdown`` adds the engine's own memory accounting."""

    def __init__(self, engine: Any, breakdown: Callable[[], dict[str, int]] | None = None) -> None:
        self.engine = engine
        self.breakdown = breakdown
        self.phases = Phases()

    def train_step(self, micro: list[MicroBatch], measure: bool = False) -> tuple[float, dict[str, Any] | None]:
        """See :class:`benchmarks.harness.systems.base.Trainer`; clipping is the engine's ``gradient_clipping``."""
        total = 0.0
        state: dict[str, Any] | None = None
        n = len(micro)
        self.phases.start()
        for i, (x, y) in enumerate(micro):
            loss = self.engine(x, y)
            self.phases.lap("forward")
            self.engine.backward(loss)
            self.phases.lap("backward")
            total += float(loss.detach())
            if measure and i == n - 1:
                t = time.perf_counter()
                state = timed_census([self.engine])
                if self.breakdown is not None:
                    state.update(self.breakdown())
                state["census_s"] = time.perf_counter() - t
                state.setdefault("total", state["census"])
                self.phases.lap("census")
            self.engine.step()
            self.phases.lap("optimizer")
        return total / n, state
