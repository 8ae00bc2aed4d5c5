"""Writing DeepSpeed's pickled checkpoint files without importing DeepSpeed.

DeepSpeed's ``*_optim_states.pt`` files hold, besides tensors and plain data, a few DeepSpeed
objects that its loader uses as they are: the loss scaler (``LossScaler`` /
``DynamicLossScaler``, which replaces the engine's own on load) and ``ZeroStageEnum``. A pickle
refers to a class by module and name only, so :class:`DeepSpeedObject` stands in for such an
object and :func:`save` writes it as DeepSpeed would (class reference, then the instance
``__dict__``, or an enum call), while tensors still go through ``torch.save``'s storage records.
Nothing here is ever *read* back with pickle: zeroshard reads these files with
:mod:`zeroshard.checkpoint.unpickle`, which runs no code.
"""

from __future__ import annotations

import pickle
import types
from pathlib import Path
from typing import Any

import torch

#: Where DeepSpeed 0.19 defines the classes its checkpoints reference.
LOSS_SCALER = ("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
DYNAMIC_LOSS_SCALER = ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")
ZERO_STAGE_ENUM = ("deepspeed.runtime.zero.config", "ZeroStageEnum")


class _Global:
    """A class reference by name (pickled as ``GLOBAL module name``), for classes we do not import."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name


class DeepSpeedObject:
    """An instance of a DeepSpeed class: ``cls.__new__(cls)`` with ``state`` as its ``__dict__``
    (how pickle stores plain objects), or ``cls(*call_args)`` when ``call_args`` is given (enums)."""

    def __init__(self, where: tuple[str, str], state: dict[str, Any] | None = None,
                 call_args: tuple[Any, ...] | None = None) -> None:
        self.cls = _Global(*where)
        self.state = state
        self.call_args = call_args


def zero_stage(stage: int) -> DeepSpeedObject:
    """``ZeroStageEnum(stage)``."""
    return DeepSpeedObject(ZERO_STAGE_ENUM, call_args=(int(stage),))


_PythonPickler: Any = pickle._Pickler  # the pure-Python pickler, whose ``save`` can be extended


class _DSPickler(_PythonPickler):
    """Writes :class:`DeepSpeedObject` as pickle itself writes such objects: ``GLOBAL module name``
    then ``NEWOBJ`` + ``BUILD`` (plain objects) or ``REDUCE`` (enums)."""

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if not isinstance(obj, DeepSpeedObject):
            super().save(obj, save_persistent_id)
            return
        memo = self.memo.get(id(obj))
        if memo is not None:
            self.write(self.get(memo[0]))
            return
        self.write(pickle.GLOBAL + f"{obj.cls.module}\n{obj.cls.name}\n".encode())
        if obj.call_args is not None:
            self.save(obj.call_args)
            self.write(pickle.REDUCE)
            self.memoize(obj)
            return
        self.save(())
        self.write(pickle.NEWOBJ)
        self.memoize(obj)
        self.save(obj.state or {})
        self.write(pickle.BUILD)


_PICKLE_MODULE = types.SimpleNamespace(__name__="zeroshard.checkpoint.ds_pickle", Pickler=_DSPickler)


def save(obj: Any, path: Path) -> None:
    """``torch.save`` of ``obj``, with :class:`DeepSpeedObject` written as DeepSpeed's classes."""
    torch.save(obj, path, pickle_module=_PICKLE_MODULE)
