"""DeepSpeed's LR schedules and :func:`build_scheduler` for a config's ``"scheduler"`` section.

DeepSpeed's ``_scheduler_from_config`` calls ``getattr(deepspeed.runtime.lr_schedules, type)`` with
``optimizer`` and ``**params``, falling back to ``torch.optim.lr_scheduler`` for other names.
zeroshard accepts only DeepSpeed's own schedules (:data:`SUPPORTED_SCHEDULERS`, matched
case-insensitively): torch's schedulers have their own semantics (per-epoch counting, their own
state) and a user who wants one can build it in Python and hand it over directly.
"""

from __future__ import annotations

import inspect
from typing import Any

from zeroshard.errors import ConfigError
from zeroshard.optim._schedule_base import BatchSchedule
from zeroshard.optim.cyclic import LRRangeTest, OneCycle
from zeroshard.optim.warmup import WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = [
    "SUPPORTED_SCHEDULERS",
    "BatchSchedule",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_scheduler",
]

_CLASSES: dict[str, type[BatchSchedule]] = {
    cls.__name__.lower(): cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)
}

SUPPORTED_SCHEDULERS: tuple[str, ...] = tuple(cls.__name__ for cls in _CLASSES.values())
"""Scheduler ``type`` names :func:`build_scheduler` accepts (matched case-insensitively)."""


def _signature(cls: type[BatchSchedule]) -> tuple[list[str], list[str]]:
    """The config parameter names of ``cls`` (all, then the required ones)."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[2:]  # self, optimizer
    names = [p.name for p in parameters]
    required = [p.name for p in parameters if p.default is inspect.Parameter.empty]
    return names, required


def build_scheduler(sched_type: str, params: dict[str, Any] | None, optimizer: Any) -> BatchSchedule:
    """Build the LR schedule a DeepSpeed config describes.

    As in DeepSpeed, the schedule is built with ``last_batch_iteration=-1`` unless the params say
    otherwise, so it immediately writes its starting LR into ``optimizer``.

    Args:
        sched_type: the config's ``scheduler.type``, one of :data:`SUPPORTED_SCHEDULERS`.
        params: the config's ``scheduler.params`` (may be ``None``): the class's keyword arguments.
        optimizer: the torch optimizer to schedule (or a wrapper with ``.optimizer``).

    Returns:
        The schedule; call its ``step()`` once per optimizer step.

    Raises:
        ConfigError: unknown type (key ``scheduler.type``), unknown, missing or invalid parameter
            (key ``scheduler.params.<name>``).
    """
    supported = ", ".join(SUPPORTED_SCHEDULERS)
    if not isinstance(sched_type, str) or sched_type.lower() not in _CLASSES:
        raise ConfigError(
            f"unknown LR scheduler {sched_type!r}; supported: {supported} (torch.optim.lr_scheduler "
            "classes are not accepted in the config: build one in Python and pass it directly)",
            key="scheduler.type",
        )
    cls = _CLASSES[sched_type.lower()]
    options = dict(params or {})
    names, required = _signature(cls)
    for name in options:
        if name not in names:
            hint = ""
            if cls is WarmupCosineLR and name in ("warmup_min_lr", "warmup_max_lr"):
                hint = " (WarmupCosineLR scales the optimizer's own lr: use warmup_min_ratio / cos_min_ratio)"
            raise ConfigError(
                f"unknown parameter {name!r} for {cls.__name__}; valid parameters: {', '.join(names)}{hint}",
                key=f"scheduler.params.{name}",
            )
    for name in required:
        if name not in options:
            raise ConfigError(f"{cls.__name__} requires this parameter", key=f"scheduler.params.{name}")
    return cls(optimizer, **options)
