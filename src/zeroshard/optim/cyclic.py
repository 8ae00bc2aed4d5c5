"""DeepSpeed's ``OneCycle`` and ``LRRangeTest`` schedules (Smith, https://arxiv.org/abs/1803.09820).

Formulas, parameter names, defaults and step semantics are DeepSpeed 0.19.8's, including its quirks:

* ``OneCycle`` cycles momentum only for optimizers with ``betas`` in their defaults (Adam-like); for
  others (SGD) ``cycle_momentum`` is switched off with a warning. The cycled value is ``beta1``;
  ``beta2`` is set to ``0.99`` whatever the optimizer had.
* At construction (``last_batch_iteration=-1``) ``OneCycle`` sets LR ``cycle_min_lr`` and momentum
  ``cycle_min_mom``; the first ``step()`` moves to iteration 0, already one batch into the cycle.
* After the cycle, LR decays as ``cycle_min_lr / (1 + decay_lr_rate * k / decay_step_size)`` and
  momentum *grows* as ``cycle_max_mom * (1 + decay_mom_rate * k / decay_step_size)``, where ``k``
  counts batches since the cycle ended; a zero ``decay_step_size`` or rate disables the decay.

Divergence: DeepSpeed's ``OneCycle.get_last_lr()`` fails until the first ``step()``; zeroshard's
returns the LRs set at construction.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from zeroshard.errors import ConfigError
from zeroshard.optim import _validate as check
from zeroshard.optim._schedule_base import BatchSchedule, per_group, update_lr

logger = logging.getLogger(__name__)

_P = "scheduler.params"
_BETA2 = 0.99  # DeepSpeed's OneCycle pins beta2 here


class OneCycle(BatchSchedule):
    """One cycle of LR (up, then down) with inverse momentum, then optional decay.

    Args:
        optimizer: a torch optimizer (or a wrapper with ``.optimizer``).
        cycle_min_lr: lower LR bound, a number or one per param group (required).
        cycle_max_lr: upper LR bound, a number or one per param group (required).
        decay_lr_rate: post-cycle LR decay rate. Default 0.
        cycle_first_step_size: batches in the rising half. Default 2000.
        cycle_second_step_size: batches in the falling half. Default ``None``: same as the first.
        cycle_first_stair_count: stairs in the rising half; ``<= 0`` is continuous. Default 0.
        cycle_second_stair_count: stairs in the falling half. Default ``None``: same as the first.
        decay_step_size: batches per post-cycle decay interval; 0 disables decay. Default 0.
        cycle_momentum: cycle ``beta1`` inversely to the LR. Default ``True``.
        cycle_min_mom: lower momentum bound. Default 0.8.
        cycle_max_mom: upper momentum bound. Default 0.9.
        decay_mom_rate: post-cycle momentum decay rate. Default 0.
        last_batch_iteration: index of the last batch done; ``-1`` starts from scratch.
    """

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: Any,
        cycle_max_lr: Any,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: float = 2000,
        cycle_second_step_size: float | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: float = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: Any = 0.8,
        cycle_max_mom: Any = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer)
        last = check.integer(last_batch_iteration, f"{_P}.last_batch_iteration", minimum=-1)
        self._init_cycle(
            cycle_first_step_size,
            cycle_second_step_size,
            cycle_first_stair_count,
            cycle_second_stair_count,
            decay_step_size,
        )

        self.min_lrs = per_group(self.optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = per_group(self.optimizer, cycle_max_lr, "cycle_max_lr")
        if last == -1:
            self._last_lr = update_lr(self.optimizer.param_groups, self.min_lrs)
        self.decay_lr_rate = check.number(decay_lr_rate, f"{_P}.decay_lr_rate")
        if math.isclose(self.decay_lr_rate, 0):
            self.skip_lr_decay = True

        self.cycle_momentum = check.boolean(cycle_momentum, f"{_P}.cycle_momentum")
        if self.cycle_momentum:
            self._init_momentum(cycle_min_mom, cycle_max_mom, decay_mom_rate, last)
        self.last_batch_iteration = last

    def _init_cycle(
        self, first_size: Any, second_size: Any, first_stairs: Any, second_stairs: Any, decay_step_size: Any
    ) -> None:
        first = check.number(first_size, f"{_P}.cycle_first_step_size")
        if first <= 0:
            raise ConfigError(f"must be positive, got {first_size!r}", key=f"{_P}.cycle_first_step_size")
        second = (
            first if second_size is None else check.number(second_size, f"{_P}.cycle_second_step_size", minimum=0.0)
        )
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_step_size = first
        self.second_step_size = second
        self.first_stair_count = check.integer(first_stairs, f"{_P}.cycle_first_stair_count")
        self.second_stair_count = (
            self.first_stair_count
            if second_stairs is None
            else check.integer(second_stairs, f"{_P}.cycle_second_stair_count")
        )
        self.decay_step_size = check.number(decay_step_size, f"{_P}.decay_step_size", minimum=0.0)
        self.skip_lr_decay = self.skip_mom_decay = math.isclose(self.decay_step_size, 0)

    def _init_momentum(self, min_mom: Any, max_mom: Any, decay_mom_rate: Any, last: int) -> None:
        if "betas" not in self.optimizer.defaults:
            logger.warning(
                "cycle_momentum is disabled because optimizer %s has no betas", type(self.optimizer).__name__
            )
            self.cycle_momentum = False
            return
        self.decay_mom_rate = check.number(decay_mom_rate, f"{_P}.decay_mom_rate")
        self.min_moms = [(mom, _BETA2) for mom in per_group(self.optimizer, min_mom, "cycle_min_mom")]
        self.max_moms = [(mom, _BETA2) for mom in per_group(self.optimizer, max_mom, "cycle_max_mom")]
        if last == -1:
            for momentum, group in zip(self.min_moms, self.optimizer.param_groups, strict=False):
                group["betas"] = momentum
        if math.isclose(self.decay_mom_rate, 0):
            self.skip_mom_decay = True

    def _get_scale_factor(self) -> float:
        batch_iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale_factor = x / self.step_ratio
            stair_count = self.first_stair_count
        else:
            scale_factor = (x - 1) / (self.step_ratio - 1)
            stair_count = self.second_stair_count
        if stair_count > 0:
            # Quantised from the integer batch offset, as DeepSpeed does, not from scale_factor
            # (which can land 1 ulp under a stair at a half-cycle boundary).
            cycle_iteration = batch_iteration % self.total_size
            if cycle_iteration <= self.first_step_size:
                stair_position = cycle_iteration * stair_count / self.first_step_size
            else:
                stair_position = (self.total_size - cycle_iteration) * stair_count / self.second_step_size
            scale_factor = math.floor(stair_position) / stair_count
        return scale_factor

    def get_lr(self) -> list[Any]:
        """The LR of each group at ``last_batch_iteration``."""
        if self.last_batch_iteration < self.total_size:
            scale = self._get_scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]
        if self.skip_lr_decay:
            return self.min_lrs
        k = self.last_batch_iteration - self.total_size + 1
        factor = 1 + self.decay_lr_rate * (k / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """The ``betas`` of each group at ``last_batch_iteration``, or ``None`` without momentum cycling."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._get_scale_factor()
            return [
                (hi[0] - (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms, strict=True)
            ]
        if self.skip_mom_decay:
            return self.max_moms
        k = self.last_batch_iteration - self.total_size + 1
        factor = 1 + self.decay_mom_rate * (k / self.decay_step_size)
        return [(beta1 * factor, beta2) for beta1, beta2 in self.max_moms]

    def step(self, batch_iteration: int | None = None) -> None:
        """Advance to ``batch_iteration`` (default: the next batch); set LRs and, if cycled, betas."""
        self._advance(batch_iteration)
        momentums = self.get_mom()
        if momentums is not None:
            for group, momentum in zip(self.optimizer.param_groups, momentums, strict=False):
                group["betas"] = momentum


class LRRangeTest(BatchSchedule):
    """Grow the LR from ``lr_range_test_min_lr`` to find the largest stable LR.

    ``lr = min_lr * (1 + step_rate * (n + 1) / step_size)``, with the fraction floored when
    ``lr_range_test_staircase`` is set.

    Args:
        optimizer: a torch optimizer (or a wrapper with ``.optimizer``).
        lr_range_test_min_lr: starting LR, a number or one per param group. Default ``1e-3``.
        lr_range_test_step_size: batches per LR increase, a positive int. Default 2000.
        lr_range_test_step_rate: growth rate. Default 1.0.
        lr_range_test_staircase: grow in steps rather than continuously. Default ``False``.
        last_batch_iteration: index of the last batch done; ``-1`` starts from scratch.
    """

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: Any = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer)
        self.min_lr = per_group(self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = check.integer(lr_range_test_step_size, f"{_P}.lr_range_test_step_size", minimum=1)
        self.step_rate = check.number(lr_range_test_step_rate, f"{_P}.lr_range_test_step_rate")
        self.staircase = check.boolean(lr_range_test_staircase, f"{_P}.lr_range_test_staircase")
        self.last_batch_iteration = check.integer(last_batch_iteration, f"{_P}.last_batch_iteration", minimum=-1)
        if self.last_batch_iteration == -1:
            self._last_lr = update_lr(self.optimizer.param_groups, self.min_lr)

    def _interval(self) -> float:
        if self.staircase:
            return math.floor(float(self.last_batch_iteration + 1) / self.step_size)
        return float(self.last_batch_iteration + 1) / self.step_size

    def get_lr(self) -> list[Any]:
        """The LR of each group at ``last_batch_iteration``."""
        increase = 1 + self.step_rate * self._interval()
        return [min_lr * increase for min_lr in self.min_lr]

    def step(self, batch_iteration: int | None = None) -> None:
        """Advance to ``batch_iteration`` (default: the next batch) and set the LRs."""
        self._advance(batch_iteration)
