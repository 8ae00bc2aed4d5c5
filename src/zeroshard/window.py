"""The gradient-accumulation window: which micro-step the engine is at, and what this window saw.

One object owns the counters DeepSpeed scripts read on the engine (``global_steps``,
``micro_steps``, ``global_samples``, ``skipped_steps``), the boundary decision (counted, or set by
hand with ``set_gradient_accumulation_boundary``), the forwards and backwards of the window (for
the ranks' agreement check), its losses (for the step log) and ``no_sync``. The engine asks it and
tells it; nothing else writes these counters except through its methods.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zeroshard.core.clock import StepClock

__all__ = ["AccumulationWindow"]

#: gives the accumulation steps now
StepsFn = Callable[[], int]


class AccumulationWindow:
    """Micro-steps of ``steps`` per optimizer step (``gradient_accumulation_steps``).

    Args:
        steps: a callable giving the accumulation steps now (the config's, which
            ``set_train_batch_size`` may change).
        clock: the optimizer-step counter shared with the core (its errors name the step).
        device: where the window's loss sum is kept (no host sync per micro-step).
    """

    def __init__(self, steps: StepsFn, clock: StepClock, device: torch.device) -> None:
        self._steps = steps
        self.clock = clock
        #: micro-steps since training began (DeepSpeed's ``micro_steps``)
        self.micro_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        #: forwards and backwards in this window (ZeRO-3 forwards only: stages 0-2 may run
        #: forwards on some ranks only, without collectives)
        self.forwards = 0
        self.backwards = 0
        #: set by ``set_gradient_accumulation_boundary``; ``None``: the micro-step counter decides
        self.boundary_override: bool | None = None
        #: inside ``no_sync()``: backwards accumulate without reducing
        self.no_sync = False
        #: whether the latest ``step()`` updated the parameters
        self.step_applied = False
        self._extra_steps_warned = False
        self._loss = torch.zeros((), dtype=torch.float32, device=device)
        self._losses = 0

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken (applied or skipped)."""
        return self.clock()

    @global_steps.setter
    def global_steps(self, value: int) -> None:
        self.clock.set(value)

    @property
    def accumulation_steps(self) -> int:
        """Micro-steps per optimizer step now."""
        return self._steps()

    @property
    def position(self) -> int:
        """This micro-step's index in its window (0-based)."""
        return self.micro_steps % self.accumulation_steps

    def is_boundary(self) -> bool:
        """Whether the current micro-step ends the window: the hand-set value once set, else the count."""
        if self.boundary_override is not None:
            return self.boundary_override
        return (self.micro_steps + 1) % self.accumulation_steps == 0

    def add_loss(self, loss: torch.Tensor) -> None:
        """A backward's loss, for the window's mean (kept on the device)."""
        self._loss += loss.detach().float().sum()
        self._losses += 1

    def mean_loss(self) -> torch.Tensor:
        """The mean of the losses added since the last :meth:`clear_losses` (a device tensor)."""
        return self._loss / max(self._losses, 1)

    def clear_losses(self) -> None:
        """Forget the losses of the window (after it was reported, or a checkpoint replaced it)."""
        self._loss.zero_()
        self._losses = 0

    def step_calls(self) -> int:
        """This window's ``step()`` calls so far, the current one included."""
        return self.position + 1

    def first_extra_step(self) -> bool:
        """Whether a boundary came after more ``step()`` calls than backwards, for the first time
        (the engine warns once)."""
        if self._extra_steps_warned or self.step_calls() <= self.backwards:
            return False
        self._extra_steps_warned = True
        return True

    def count_micro_step(self) -> None:
        """A ``step()`` between boundaries: one more micro-step."""
        self.micro_steps += 1

    def close(self) -> None:
        """A boundary ``step()``: the counter starts the next window (with a boundary set by hand,
        fewer step() calls than accumulation steps may have come: accelerate's one per window)."""
        ga = self.accumulation_steps
        self.micro_steps = (self.micro_steps // ga + 1) * ga
        self.restart()

    def restart(self) -> None:
        """A new window begins: no forwards or backwards in it yet."""
        self.forwards = self.backwards = 0

    def stepped(self, applied: bool, samples: int) -> None:
        """The optimizer step of the window was taken (``applied``) or skipped."""
        self.step_applied = applied
        if not applied:
            self.skipped_steps += 1
        self.clock.set(self.clock() + 1)
        self.global_samples += samples

    def recount_from_steps(self) -> None:
        """Re-derive the micro-step counter from the optimizer steps (after a checkpoint load or a
        change of accumulation steps), so that the next window is a whole one."""
        self.micro_steps = self.global_steps * self.accumulation_steps
