"""``deepspeed.runtime.zero.parameter_offload``'s parameter dict: DeepSpeed's ``ZeROOrderedDict``.

DeepSpeed replaces a ZeRO-3 module's ``_parameters`` with a ``ZeROOrderedDict`` whose item access
gathers a parameter read outside its own module's forward. zeroshard does the same with
:class:`~zeroshard.core.zero3.param_reads.GatheringParams` on every module whose parameters a ZeRO-3
engine partitions, so ``isinstance(module._parameters, ZeROOrderedDict)`` is true there. One built
by hand (``ZeROOrderedDict(parent_module=m)``, :func:`ensure_zero_ordered_dict`) gathers nothing
until an engine watches its module: no module call of an engine is in progress for it.
"""

from __future__ import annotations

from typing import Any

import torch

from zeroshard.core.zero3.param_reads import GatheringParams

__all__ = ["ZeROOrderedDict", "ensure_zero_ordered_dict"]


class _NoEngine:
    """The watcher of a dict no engine watches: never inside a module call, so reads gather nothing."""

    calls: list[Any] = []

    def read_outside_module(self, unit: Any) -> None:
        """Never called: :attr:`calls` is empty."""


class _GatheringParamsType(type):
    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, GatheringParams)


class ZeROOrderedDict(GatheringParams, metaclass=_GatheringParamsType):
    """DeepSpeed's name for a module's gathering parameter dict (any :class:`GatheringParams` is one)."""

    def __init__(self, parent_module: torch.nn.Module | None = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.watcher = _NoEngine()


def ensure_zero_ordered_dict(module: Any) -> None:
    """Give ``module`` a :class:`ZeROOrderedDict` with its parameters if its ``_parameters`` is a plain
    dict, keeping the first container it had as ``_original_parameters`` (DeepSpeed's helper); a
    module whose dict is one already, or an object without ``_parameters``, is left as it is."""
    params = getattr(module, "_parameters", None)
    if params is None or isinstance(params, GatheringParams):
        return
    if "_original_parameters" not in vars(module):
        module._original_parameters = params
    converted = ZeROOrderedDict(parent_module=module)
    converted.update(params)
    module._parameters = converted
