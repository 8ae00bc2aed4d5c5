"""The one way in: what the engine, checkpoints, ``zero.*`` helpers and the estimator may use of a stage.

Code outside :mod:`zeroshard.core` reaches a stage through :class:`Stage` (typed, checked by
mypy) and a parameter's stage and unit through :func:`owner_of` / :func:`unit_of`, never through
private attributes or string tags. This module owns the tags: it is the only place that writes
them on parameters.

Code that must react to parameter transitions without the core knowing it (DeepSpeed's ``ds_*``
attributes: :mod:`zeroshard.deepspeed.param_attrs`) implements :class:`ParamObserver` and is handed to
the builder, which passes it to every unit it constructs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from zeroshard.core.grad_sync import GradSync
    from zeroshard.core.master import MasterShard
    from zeroshard.core.offload.state_store import StateStore
    from zeroshard.core.precision import LossScaler, PrecisionPolicy
    from zeroshard.core.zero3.coordinator import ParamCoordinator
    from zeroshard.core.zero3.frozen import FrozenShard
    from zeroshard.core.zero3.param_unit import ParamUnit, UnitState
    from zeroshard.core.zero_optimizer import StageSpec

__all__ = ["NO_OBSERVER", "ParamObserver", "Stage", "coordinator_of", "owner_of", "set_owner", "set_unit",
           "the_unit", "unit_of"]

_OWNER = "_zeroshard_owner"
_UNIT = "_zeroshard_unit"


@runtime_checkable
class Stage(Protocol):
    """What a ZeRO stage offers to the layers above the core (``ZeroOptimizer`` and ``Stage3Optimizer``).

    Hooks around autograd (:meth:`start_backward`, :meth:`finish_backward`), the step, write-back
    of edited parameters, the shards it holds and its memory. ``coordinator`` is the ZeRO-3 unit
    coordinator (gather, prefetch, release), ``None`` at stages 0-2.
    """

    spec: StageSpec
    policy: PrecisionPolicy
    scaler: LossScaler
    master: MasterShard
    sync: GradSync
    store: StateStore
    group: Any
    device: torch.device
    rank: int
    world: int
    global_grad_norm: float | None
    optimizer: torch.optim.Optimizer | None
    #: ZeRO-3's shard of the frozen parameters (``None``: stages 0-2, or every parameter trains)
    frozen: FrozenShard | None

    @property
    def coordinator(self) -> ParamCoordinator | None: ...

    @property
    def replica(self) -> int: ...

    def start_backward(self, boundary: bool) -> None: ...

    def finish_backward(self) -> None: ...

    def step(self, *, by_engine: bool = False) -> bool: ...

    def zero_grad(self) -> None: ...

    def publish(self) -> None: ...

    def grad_shard(self) -> list[torch.Tensor]: ...

    def current_grad_norm(self) -> float: ...

    def write_back(self, p: torch.nn.Parameter) -> None: ...

    def gather_context(self, params: list[torch.nn.Parameter]) -> tuple[Callable[[], None], Callable[[], None]]: ...

    def rebind_parameters(self, keep_values: bool) -> None: ...

    def memory_breakdown(self) -> dict[str, int]: ...

    def memory_placement(self) -> dict[str, dict[str, int]]: ...

    def detach(self) -> None: ...


class ParamObserver(Protocol):
    """Told of each parameter a stage shards and of each unit's state changes (DeepSpeed's ``ds_*``
    attributes live in such an observer, outside the core)."""

    def partitioned(self, p: torch.nn.Parameter, shape: torch.Size, world: int, persistent: bool,
                    shard: torch.Tensor | None) -> None:
        """``p`` is now held as a shard over ``world`` ranks (``shard``: this rank's, or ``None`` in a file)."""

    def state_changed(self, params: Iterable[torch.nn.Parameter], state: UnitState) -> None:
        """The unit holding ``params`` entered ``state``."""


class _NoObserver:
    def partitioned(self, p: torch.nn.Parameter, shape: torch.Size, world: int, persistent: bool,
                    shard: torch.Tensor | None) -> None:
        return None

    def state_changed(self, params: Iterable[torch.nn.Parameter], state: UnitState) -> None:
        return None


#: the observer of a stage built without one
NO_OBSERVER: ParamObserver = _NoObserver()


def owner_of(p: torch.Tensor) -> Stage | None:
    """The stage that trains or partitions ``p`` (``None``: no engine has taken it)."""
    return getattr(p, _OWNER, None)


def set_owner(p: torch.Tensor, stage: Stage) -> None:
    """Record that ``stage`` owns ``p`` (the builder, once per parameter)."""
    setattr(p, _OWNER, stage)


def unit_of(p: torch.Tensor) -> ParamUnit | None:
    """The ZeRO-3 unit ``p`` is gathered with (``None`` at stages 0-2 or before ``initialize``)."""
    return getattr(p, _UNIT, None)


def the_unit(p: torch.Tensor) -> ParamUnit:
    """The ZeRO-3 unit of ``p``, which must have one (a parameter a stage-3 engine partitioned)."""
    unit = unit_of(p)
    if unit is None:
        raise KeyError("the parameter belongs to no ZeRO-3 unit")
    return unit


def set_unit(p: torch.Tensor, unit: ParamUnit) -> None:
    """Record the unit that holds ``p`` (the unit itself, when it adopts ``p``)."""
    setattr(p, _UNIT, unit)


def coordinator_of(stage: Stage | None) -> ParamCoordinator | None:
    """The ZeRO-3 coordinator of ``stage``, or ``None`` (stages 0-2, no stage)."""
    return stage.coordinator if stage is not None else None
