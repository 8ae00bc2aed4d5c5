"""DeepSpeed's warmup schedules: ``WarmupLR``, ``WarmupDecayLR`` and ``WarmupCosineLR``.

Formulas, parameter names, defaults and step semantics are DeepSpeed 0.19.8's. With ``n`` the
``last_batch_iteration`` and ``W = max(2, warmup_num_steps)``, the warmup fraction is
``log(n + 1) / log(W)`` for ``warmup_type="log"`` (the default) and ``n / W`` for ``"linear"``. When
constructed with ``last_batch_iteration=-1`` (the default) the schedule writes its step ``-1`` LR into
the optimizer at once (``warmup_min_lr``, or ``0`` for ``WarmupCosineLR``); the first ``step()``
then moves to iteration 0.

Divergence: DeepSpeed logs a warning and falls back to ``"log"`` for an unknown ``warmup_type``;
zeroshard raises ``ConfigError`` instead, since a typo would silently change the schedule.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from zeroshard.errors import ConfigError
from zeroshard.optim import _validate as check
from zeroshard.optim._schedule_base import BatchSchedule, per_group, update_lr

logger = logging.getLogger(__name__)

WARMUP_LOG = "log"
WARMUP_LINEAR = "linear"
_P = "scheduler.params"


def _warmup_type(value: Any) -> str:
    if value not in (WARMUP_LOG, WARMUP_LINEAR):
        raise ConfigError(f"expected 'log' or 'linear', got {value!r}", key=f"{_P}.warmup_type")
    return str(value)


def _warmup_steps(value: Any) -> int:
    return check.integer(value, f"{_P}.warmup_num_steps", minimum=1)


def _last_iteration(value: Any) -> int:
    return check.integer(value, f"{_P}.last_batch_iteration", minimum=-1)


def _warn_short(total_num_steps: float, warmup_num_steps: int) -> None:
    if total_num_steps < warmup_num_steps:
        logger.warning("total_num_steps %s is less than warmup_num_steps %s", total_num_steps, warmup_num_steps)


class WarmupLR(BatchSchedule):
    """Raise each group's LR from ``warmup_min_lr`` to ``warmup_max_lr`` over the warmup, then hold it.

    Args:
        optimizer: a torch optimizer (or a wrapper with ``.optimizer``).
        warmup_min_lr: starting LR, a number or one per param group. Default ``0.0``.
        warmup_max_lr: final LR, a number or one per param group. Default ``None``: each group's
            current LR (DeepSpeed 0.19.8 behaviour).
        warmup_num_steps: warmup length in batches, a positive int (raised to at least 2). Default 1000.
        warmup_type: ``"log"`` (default) or ``"linear"``.
        last_batch_iteration: index of the last batch done; ``-1`` starts from scratch.
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: Any = 0.0,
        warmup_max_lr: Any = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ) -> None:
        steps = _warmup_steps(warmup_num_steps)
        super().__init__(optimizer)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in self.optimizer.param_groups]
            self.max_lrs = list(warmup_max_lr)
        else:
            self.max_lrs = per_group(self.optimizer, warmup_max_lr, "warmup_max_lr")
        self.min_lrs = per_group(self.optimizer, warmup_min_lr, "warmup_min_lr")
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs, strict=True)]
        self.warmup_num_steps = max(2, steps)
        self.warmup_type = _warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = _last_iteration(last_batch_iteration)
        if self.last_batch_iteration == -1:
            self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())

    def _warmup_gamma(self) -> float:
        if self.warmup_type == WARMUP_LOG:
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return 1.0

    def get_lr(self) -> list[Any]:
        """``min_lr + (max_lr - min_lr) * gamma`` per group; ``warmup_min_lr`` before the start."""
        if self.last_batch_iteration < 0:
            return self.min_lrs
        gamma = self._get_gamma()
        return [min_lr + (delta_lr * gamma) for min_lr, delta_lr in zip(self.min_lrs, self.delta_lrs, strict=True)]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: the next batch) and set the LRs."""
        self._advance(last_batch_iteration)


class WarmupDecayLR(WarmupLR):
    """``WarmupLR``, then a linear decay reaching 0 at ``total_num_steps``.

    Args:
        optimizer: a torch optimizer (or a wrapper with ``.optimizer``).
        total_num_steps: total training batches (required).
        warmup_min_lr: starting LR. Default ``0.0``.
        warmup_max_lr: peak LR. Default ``0.001`` (unlike ``WarmupLR``, not the optimizer's LR).
        warmup_num_steps: warmup length in batches. Default 1000.
        warmup_type: ``"log"`` (default) or ``"linear"``.
        last_batch_iteration: index of the last batch done; ``-1`` starts from scratch.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: float,
        warmup_min_lr: Any = 0.0,
        warmup_max_lr: Any = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ) -> None:
        check.number(total_num_steps, f"{_P}.total_num_steps", minimum=0.0)
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        _warn_short(total_num_steps, self.warmup_num_steps)

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return max(
            0.0,
            float(self.total_num_steps - self.last_batch_iteration)
            / float(max(1.0, self.total_num_steps - self.warmup_num_steps)),
        )


class WarmupCosineLR(BatchSchedule):
    """Scale each group's own LR by a ratio: warm up to 1, then cosine-decay to ``cos_min_ratio``.

    The ratio multiplies the LR each group had when the schedule was built, so this schedule takes
    ratios, not ``warmup_min_lr``/``warmup_max_lr``.

    Args:
        optimizer: a torch optimizer (or a wrapper with ``.optimizer``).
        total_num_steps: total training batches (required); the ratio stays at ``cos_min_ratio`` after.
        warmup_min_ratio: ratio at the start of the warmup. Default ``0.0``.
        warmup_num_steps: warmup length in batches, a positive int (raised to at least 2). Default 1000.
        cos_min_ratio: ratio at the end of the cosine decay. Default ``0.0001``.
        warmup_type: ``"log"`` (default) or ``"linear"``.
        last_batch_iteration: index of the last batch done; ``-1`` starts from scratch.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: float,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ) -> None:
        steps = _warmup_steps(warmup_num_steps)
        super().__init__(optimizer)
        check.number(total_num_steps, f"{_P}.total_num_steps", minimum=0.0)
        self.total_num_steps = total_num_steps
        self.last_batch_iteration = _last_iteration(last_batch_iteration)
        check.number(cos_min_ratio, f"{_P}.cos_min_ratio")
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _warmup_type(warmup_type)
        check.number(warmup_min_ratio, f"{_P}.warmup_min_ratio")
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        _warn_short(total_num_steps, self.warmup_num_steps)
        self.org_lrs = [
            group["lr"].clone() if torch.is_tensor(group["lr"]) else group["lr"]
            for group in self.optimizer.param_groups
        ]
        if self.last_batch_iteration == -1:
            self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())

    def get_lr_ratio(self) -> float:
        """The multiplier of the original LRs at ``last_batch_iteration``."""
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            if self.warmup_type == WARMUP_LOG:
                ratio = self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
            else:
                ratio = self.last_batch_iteration / self.warmup_num_steps
            ratio_delta = 1.0 - self.warmup_min_ratio
            return self.warmup_min_ratio + ratio * ratio_delta
        real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        # Clamped so that past total_num_steps the ratio stays at cos_min_ratio.
        cosine_progress = min(1.0, real_last_step / real_total_steps)
        ratio_delta = 1.0 - self.cos_min_ratio
        ratio = (1 + math.cos(math.pi * cosine_progress)) / 2
        return max(0.0, self.cos_min_ratio + ratio_delta * ratio)

    def get_lr(self) -> list[Any]:
        """Each group's original LR times :meth:`get_lr_ratio`; 0 before the start."""
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        lr_ratio = self.get_lr_ratio()
        return [org_lr * lr_ratio for org_lr in self.org_lrs]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: the next batch) and set the LRs."""
        self._advance(last_batch_iteration)
