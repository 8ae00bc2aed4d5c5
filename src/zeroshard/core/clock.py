"""The optimizer step the training is at, shared by the engine (which advances it) and the core
(whose errors and agreement checks name the step)."""

from __future__ import annotations

__all__ = ["StepClock"]


class StepClock:
    """The engine's optimizer-step counter, readable by every part a builder hands it to."""

    def __init__(self, step: int = 0) -> None:
        self._step = step

    def __call__(self) -> int:
        """The current optimizer step (``global_steps``)."""
        return self._step

    def set(self, step: int) -> None:
        """Move to ``step``: after an optimizer step, or when a checkpoint is loaded."""
        self._step = int(step)
