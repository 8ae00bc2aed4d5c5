"""Common machinery of the DeepSpeed-style per-batch LR schedules.

DeepSpeed's schedules (``deepspeed/runtime/lr_schedules.py``) are not ``torch.optim.lr_scheduler``
subclasses: they count *batches* in ``last_batch_iteration`` (``-1`` = not started), set the
optimizer's LR directly on every ``step()``, accept an explicit iteration in ``step(n)``, and save
only ``{"last_batch_iteration": n}``. zeroshard mirrors that contract exactly (torch's
``LRScheduler`` would add its own initial step, ``initial_lr`` keys and step-order warnings), so
DeepSpeed scheduler checkpoints load unchanged and the LR sequences are bit-identical.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from zeroshard.errors import ConfigError
from zeroshard.optim import _validate as check


def torch_optimizer(optimizer: Any) -> Optimizer:
    """Return the torch optimizer to schedule: ``optimizer`` itself, or the one it wraps.

    Like DeepSpeed's ``get_torch_optimizer``, a wrapper (a ZeRO optimizer) is accepted when its
    ``.optimizer`` attribute is a ``torch.optim.Optimizer``.

    Raises:
        TypeError: if neither is a ``torch.optim.Optimizer``.
    """
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer and does not wrap one")


def update_lr(param_groups: list[dict[str, Any]], lrs: list[Any]) -> list[Any]:
    """Write ``lrs`` into the param groups (in place for tensor LRs) and return the groups' LRs."""
    for group, lr in zip(param_groups, lrs, strict=False):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


def per_group(optimizer: Optimizer, value: Any, name: str) -> list[Any]:
    """Broadcast a scalar to every param group, or check a per-group list (DeepSpeed's ``_format_param``).

    Args:
        optimizer: the scheduled optimizer.
        value: a number, or a list/tuple with one number per param group.
        name: the scheduler parameter name, for errors (key ``scheduler.params.<name>``).

    Raises:
        ConfigError: on a wrong-length list or a non-number.
    """
    key = f"scheduler.params.{name}"
    count = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ConfigError(f"expected one value per param group ({count}), got {len(value)}", key=key)
        for index, item in enumerate(value):
            check.number(item, f"{key}[{index}]")
        return list(value)
    check.number(value, key)
    return [value] * count


class BatchSchedule:
    """Base of the per-batch schedules: LR bookkeeping and the ``{last_batch_iteration}`` state.

    Subclasses set ``self.last_batch_iteration`` and implement :meth:`get_lr`.
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer: Optimizer = torch_optimizer(optimizer)
        self.last_batch_iteration: int = -1
        self._last_lr: list[Any] | None = None

    def get_lr(self) -> list[Any]:
        """The LR of each param group at ``last_batch_iteration``."""
        raise NotImplementedError

    def _advance(self, batch_iteration: int | None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if batch_iteration is None else batch_iteration
        self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())

    def get_last_lr(self) -> list[Any]:
        """The LRs last written to the optimizer.

        Raises:
            RuntimeError: if no LR has been set yet (construction with ``last_batch_iteration != -1``
                and no ``step()`` since).
        """
        if self._last_lr is None:
            raise RuntimeError("no learning rate computed yet: call step() first")
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        """DeepSpeed's scheduler state: ``{"last_batch_iteration": n}``."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``last_batch_iteration``; the next ``step()`` resumes the sequence from there."""
        self.last_batch_iteration = state_dict["last_batch_iteration"]
