"""ZeRO-3: a forward that reads another module's parameter gathers it, as DeepSpeed does.

A module's forward pre-hook gathers the units of its own parameters. A forward may also read a
parameter that another module owns, before or without calling that module: a head tied by hand
(``F.linear(h, self.embed.weight)``), a regulariser over a child's weight, ``x.to(self.proj.weight.dtype)``.
At rest such a parameter is an empty placeholder, so the read would see no values: a wrong result
without an error under ``no_grad``, a shape error in backward otherwise.

Each watched module's ``_parameters`` dict becomes a :class:`GatheringParams`, whose item access
(what ``module.weight`` goes through) hands a parameter whose unit is not gathered to the
coordinator while some module's forward runs; the coordinator gathers it for the innermost module
call in progress, keeps it until that call ends and gathers it again before that call's backward
(DeepSpeed's ``ZeROOrderedDict`` and external parameters). Iterating the parameters
(``named_parameters()``, ``state_dict()``, ``.to()``) does not go through item access and gathers
nothing. Outside forward nothing changes: ``GatheredParameters`` reads parameters there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

from zeroshard.core.seam import unit_of
from zeroshard.core.zero3.param_unit import ParamUnit, UnitState


class ReadWatcher(Protocol):
    """What :class:`GatheringParams` asks of the coordinator."""

    #: the units of each module call in progress, innermost last (empty outside forward)
    calls: list[Any]

    def read_outside_module(self, unit: ParamUnit) -> None:
        """Gather ``unit`` for the innermost module call in progress."""


class GatheringParams(dict[str, "torch.nn.Parameter | None"]):
    """A module's ``_parameters`` that gathers a released parameter read during a forward."""

    __slots__ = ("watcher",)

    watcher: ReadWatcher

    def __getitem__(self, key: str) -> torch.nn.Parameter | None:
        p = dict.__getitem__(self, key)
        if self.watcher.calls and p is not None:
            unit = unit_of(p)
            if unit is not None and unit.state is not UnitState.GATHERED:
                self.watcher.read_outside_module(unit)
        return p


def watch(modules: Iterable[torch.nn.Module], watcher: ReadWatcher,
          params: set[torch.nn.Parameter] | None) -> list[torch.nn.Module]:
    """Give every module with a parameter in ``params`` (``None``: every module) a :class:`GatheringParams`;
    returns them."""
    watched = []
    for m in modules:
        own = m.__dict__.get("_parameters")
        if isinstance(own, dict) and not isinstance(own, GatheringParams) and (
                params is None or any(p in params for p in own.values() if p is not None)):
            gathering = GatheringParams(own)
            gathering.watcher = watcher
            m._parameters = gathering
            watched.append(m)
    return watched


def unwatch(modules: Iterable[torch.nn.Module]) -> None:
    """Give the modules plain ``_parameters`` dicts back."""
    for m in modules:
        own = m.__dict__.get("_parameters")
        if isinstance(own, GatheringParams):
            m._parameters = dict(own)
