"""DeepSpeed's ZeRO optimizer classes, for ``isinstance`` checks only.

DeepSpeed has one optimizer class for stages 1-2 (``DeepSpeedZeroOptimizer``) and one for stage 3
(``DeepSpeedZeroOptimizer_Stage3``); scripts ask which one an engine built to tell the stage.
zeroshard's :class:`~zeroshard.core.zero_optimizer.ZeroOptimizer` serves stages 0-2 and its
subclass :class:`~zeroshard.core.zero3.stage3.Stage3Optimizer` stage 3: these names answer
``isinstance`` by that split (stage 0 included in the first: DeepSpeed builds no ZeRO optimizer
there, so no script asks). They cannot be built: ``initialize`` builds the optimizer.
"""

from __future__ import annotations

from typing import Any

from zeroshard.core.zero3.stage3 import Stage3Optimizer
from zeroshard.core.zero_optimizer import ZeroOptimizer
from zeroshard.errors import NotYetSupportedError

__all__ = ["DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3"]


class _StageCheck(type):
    _stage3: bool

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, ZeroOptimizer) and isinstance(obj, Stage3Optimizer) == cls._stage3

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise NotYetSupportedError(f"{cls.__name__} is built by initialize() in zeroshard, not directly "
                                   "(docs/deepspeed_internals.md)")


class DeepSpeedZeroOptimizer(metaclass=_StageCheck):
    """``isinstance(engine.optimizer, DeepSpeedZeroOptimizer)``: an engine at stage 1 or 2 (or 0)."""

    _stage3 = False


class DeepSpeedZeroOptimizer_Stage3(metaclass=_StageCheck):  # noqa: N801 (DeepSpeed's name)
    """``isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3)``: an engine at stage 3."""

    _stage3 = True
