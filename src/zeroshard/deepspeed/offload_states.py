"""DeepSpeed's ``engine.offload_states()`` / ``engine.reload_states()`` (and the optimizer's methods
of the same names, which OpenRLHF calls), over :class:`zeroshard.core.state_moves.StateMover`.

RLHF frameworks (OpenRLHF, verl, TRL) free the accelerator of an engine's training state while
they generate with another engine, then bring it back before the next step::

    engine.offload_states()          # everything: optim_states, hp_params, lp_params, lp_grads, contiguous_grad_buffer
    ...                              # generation, another model's forward
    engine.reload_states()           # back where it was, bit for bit

DeepSpeed 0.19.8's semantics (``deepspeed/runtime/engine.py``, ``runtime/zero/stage_1_and_2.py`` and
``stage3.py``, ``runtime/zero/offload_config.py``, ``runtime/zero/offload_states.py``):

- ``include`` names :class:`OffloadStateTypeEnum` members (or their strings); ``None`` is all of
  them. With ``offload_optimizer`` on (``cpu`` or ``nvme``) the engine drops ``hp_params`` and
  ``optim_states`` from it (already off the device), at ZeRO-3 ``lp_grads`` too. A state already
  offloaded is not moved again; :meth:`reload_states` brings back every state offloaded.
- ``device``: :class:`~zeroshard.deepspeed.misc.OffloadDeviceEnum` ``cpu`` (host memory, page-locked
  with ``pin_memory`` on an accelerator); ``none`` logs DeepSpeed's warning and does nothing; ``nvme``
  is a ``ValueError``.
- Refused, as DeepSpeed asserts (:class:`OffloadStatesError`, an ``AssertionError`` too):
  ``offload_param`` set (the parameters are offloaded already) and an engine without an optimizer.
  ZeRO stage 0 is a ``ConfigError`` naming the stage (DeepSpeed's stage-0 optimizers have no such
  method: an ``AttributeError`` there).

What each name moves here (:mod:`zeroshard.core.state_moves` says it per stage): ``optim_states``
the torch optimizer's state tensors; ``hp_params`` the fp32 master shard; ``lp_params`` the
compute-dtype parameters (stages 1-2: the module's trained parameters; stage 3: the parameter shard
and the frozen parameters' chunks); ``lp_grads`` the gradient accumulator (stage 1) or shard
(stages 2-3, between a window's first backward and its step); ``contiguous_grad_buffer`` the reduce
buckets, which zeroshard frees after every backward already: nothing to move. Where zeroshard keeps
one buffer for two of DeepSpeed's (fp32 masters at stages 1-2 are the parameters; stage 3 gathers
from the masters, which are then its parameter shard), offloading either moves it, and both are
then offloaded. Any torch optimizer's state moves (DeepSpeed's ZeRO-3 requires its FusedAdam).

While states are offloaded, :meth:`~OptimizerStateOffload.step` (``engine.step()`` at a boundary)
refuses, ``engine.backward()`` refuses when ``lp_grads`` or ``contiguous_grad_buffer`` are offloaded,
and at stages 1-2 so does ``engine(...)`` when ``lp_params`` are; a ZeRO-3 forward works (units
are gathered from the shard wherever it is). ``engine.optimizer.memory_placement()`` reports the
states where they are.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from enum import Enum
from typing import Any

import torch

from zeroshard.core.state_moves import StateKind, StateMover
from zeroshard.core.zero_optimizer import ZeroOptimizer
from zeroshard.deepspeed.misc import OffloadDeviceEnum
from zeroshard.errors import ConfigError
from zeroshard.optim.no_optimizer import NoOptimizer

__all__ = ["EngineStateOffload", "OffloadDeviceEnum", "OffloadStateTypeEnum", "OffloadStatesError",
           "OptimizerStateOffload", "get_state_devices"]

logger = logging.getLogger("zeroshard")


class OffloadStateTypeEnum(str, Enum):
    """DeepSpeed's names of the states ``offload_states(include=...)`` moves; members are the strings."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


class OffloadStatesError(ConfigError, AssertionError):
    """``offload_states()`` / ``reload_states()`` refused where DeepSpeed asserts (parameters offloaded
    by the config, no optimizer). Also an ``AssertionError``, the type DeepSpeed raises, for scripts
    that catch it."""


#: DeepSpeed's name -> the core's kind
KINDS: dict[OffloadStateTypeEnum, StateKind] = {
    OffloadStateTypeEnum.optim_states: StateKind.OPTIMIZER_STATES,
    OffloadStateTypeEnum.hp_params: StateKind.MASTER_WEIGHTS,
    OffloadStateTypeEnum.lp_params: StateKind.PARAMETERS,
    OffloadStateTypeEnum.lp_grads: StateKind.GRADIENTS,
    OffloadStateTypeEnum.contiguous_grad_buffer: StateKind.GRAD_BUFFERS,
}
_NAMES = {kind: name for name, kind in KINDS.items()}
_VALID = ", ".join(s.value for s in OffloadStateTypeEnum)


def parse_include(include: Any) -> list[OffloadStateTypeEnum]:
    """``include`` as DeepSpeed's names (``None``: all of them; one name alone is a list of one).

    Raises:
        ValueError: a name DeepSpeed does not have (DeepSpeed ignores it: a typo would offload nothing).
    """
    if include is None:
        return list(OffloadStateTypeEnum)
    items = [include] if isinstance(include, str) else include
    if not isinstance(items, Iterable):
        raise TypeError(f"offload_states(include=...) takes a list of OffloadStateTypeEnum ({_VALID}) or None, "
                        f"got {type(include).__name__}")
    out = []
    for item in items:
        try:
            out.append(OffloadStateTypeEnum(item))
        except ValueError:
            raise ValueError(f"offload_states(include=...): unknown state {item!r}; DeepSpeed's OffloadStateTypeEnum "
                             f"names {_VALID}") from None
    return list(dict.fromkeys(out))


def parse_device(device: Any) -> OffloadDeviceEnum:
    """``device`` as an :class:`OffloadDeviceEnum` (its members or their strings)."""
    try:
        return OffloadDeviceEnum(device.value if isinstance(device, Enum) else device)
    except ValueError:
        raise ValueError(f"offload_states(device={device!r}): expected OffloadDeviceEnum.cpu (or 'none', "
                         "which does nothing)") from None


def _refuse_nvme() -> ConfigError:
    return ConfigError("NVMe offload is not supported for offloading states (offload_states(device=nvme)): "
                       "states go to host memory, device=OffloadDeviceEnum.cpu")


class OptimizerStateOffload(ZeroOptimizer):
    """DeepSpeed's ZeRO optimizers' ``offload_states()``, ``reload_states()`` and ``offloaded_states``
    (a base of :class:`zeroshard.deepspeed.optimizer.DeepSpeedOptimizerViews`)."""

    @property
    def state_mover(self) -> StateMover:
        """The core's mover of this stage's state (made on first use)."""
        mover: StateMover | None = self.__dict__.get("_state_mover")
        if mover is None:
            self._check_offloadable("offload_states")
            mover = self.__dict__["_state_mover"] = StateMover(self)
        return mover

    def _check_offloadable(self, method: str) -> None:
        if self.spec.stage == 0:
            raise ConfigError(f"{method}() needs ZeRO stage 1, 2 or 3 (as DeepSpeed: its stage-0 optimizers have no "
                              f"{method}); the engine runs stage 0", key="zero_optimization.stage")
        if self.optimizer is None or isinstance(self.optimizer, NoOptimizer):
            raise OffloadStatesError("Moving states across devices is not supported without an optimizer (this engine "
                                     "was built without one, for evaluation or inference)", key="optimizer")

    @property
    def offloaded_states(self) -> set[OffloadStateTypeEnum]:
        """DeepSpeed's attribute: the states in host memory now."""
        mover: StateMover | None = self.__dict__.get("_state_mover")
        return {_NAMES[k] for k in mover.offloaded} if mover is not None else set()

    def offload_states(self, include: Any = None, device: Any = OffloadDeviceEnum.cpu, pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Move the states ``include`` names (``None``: all) to host memory, page-locked when
        ``pin_memory`` and an accelerator is present. ``non_blocking`` lets the copies overlap each
        other; they are complete on return either way."""
        self._check_offloadable("offload_states")
        states = parse_include(include)
        target = parse_device(device)
        if target is OffloadDeviceEnum.none:
            logger.warning("No device specified for offloading states.")
            return
        if target is OffloadDeviceEnum.nvme:
            raise _refuse_nvme()
        self.state_mover.offload([KINDS[s] for s in states], pin=pin_memory, non_blocking=non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring every offloaded state back to the training device (a no-op when none is offloaded)."""
        self._check_offloadable("reload_states")
        if self.__dict__.get("_state_mover") is not None:
            self.state_mover.reload(non_blocking=non_blocking)

    def _refuse_while_offloaded(self, what: str, kinds: Iterable[StateKind] | None = None) -> None:
        mover: StateMover | None = self.__dict__.get("_state_mover")
        away = set(mover.offloaded) if mover is not None else set()
        if kinds is not None:
            away &= set(kinds)
        if away:
            names = ", ".join(sorted(_NAMES[k].value for k in away))
            raise RuntimeError(f"{what} while states are offloaded by offload_states() ({names}): call "
                               "engine.reload_states() first")

    def step(self, *, by_engine: bool = False) -> bool:
        """Refused while any state is offloaded (``engine.step()`` refuses before it counts anything)."""
        self._refuse_while_offloaded("the optimizer step (engine.step())")
        return super().step(by_engine=by_engine)

    def memory_placement(self) -> dict[str, dict[str, int]]:
        """Where each kind of state is, offloaded states included."""
        out = super().memory_placement()
        mover: StateMover | None = self.__dict__.get("_state_mover")
        return mover.placement(out) if mover is not None else out


class EngineStateOffload:
    """The engine's ``offload_states()`` / ``reload_states()`` (a base of the engine API), with DeepSpeed's
    refinement of ``include`` and its refusals, over the optimizer's methods."""

    optimizer: Any
    window: Any
    zero_optimization_stage: Any
    zero_use_cpu_optimizer: Any
    zero_offload_param: Any

    def _optimizer_with_states(self) -> OptimizerStateOffload:
        inner = getattr(self.optimizer, "optimizer", None)
        if inner is None or isinstance(inner, NoOptimizer):
            raise OffloadStatesError("Moving states across devices is not supported without an optimizer (this engine "
                                     "was built without one, for evaluation or inference)", key="optimizer")
        if not isinstance(self.optimizer, OptimizerStateOffload):
            raise TypeError(f"offload_states() needs the optimizer initialize() builds, not "
                            f"{type(self.optimizer).__name__}")
        return self.optimizer

    def offload_states(self, include: Any = None, device: Any = OffloadDeviceEnum.cpu, pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Move training state to host memory until :meth:`reload_states` (DeepSpeed's
        ``offload_states``): ``include`` names :class:`OffloadStateTypeEnum` members (``None``: all;
        with ``offload_optimizer`` on, ``hp_params`` and ``optim_states`` are left out, at ZeRO-3
        ``lp_grads`` too, as DeepSpeed), ``device`` must be ``OffloadDeviceEnum.cpu`` (``none`` does
        nothing), ``pin_memory`` page-locks the host copies on an accelerator.

        Raises:
            OffloadStatesError: ``offload_param`` is set, or the engine has no optimizer (DeepSpeed's assertions).
            ConfigError: ``device`` is ``nvme`` (a ``ValueError``, as DeepSpeed's), or ZeRO stage 0.
            ValueError: ``include`` names a state DeepSpeed does not have.
        """
        states = parse_include(include)
        target = parse_device(device)
        if self.zero_use_cpu_optimizer():
            left_out = {OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states}
            if self.zero_optimization_stage() >= 3:
                left_out.add(OffloadStateTypeEnum.lp_grads)
            states = [s for s in states if s not in left_out]
        if self.zero_offload_param() is not None:
            raise OffloadStatesError("Moving states across devices is not supported for offloaded parameters "
                                     "(offload_param moves the parameter shard already)",
                                     key="zero_optimization.offload_param.device")
        optimizer = self._optimizer_with_states()
        if target is OffloadDeviceEnum.none:
            logger.warning("No device specified for offloading states.")
            return
        if target is OffloadDeviceEnum.nvme:
            raise _refuse_nvme()
        optimizer.offload_states(include=states, device=target, pin_memory=pin_memory, non_blocking=non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring the states :meth:`offload_states` moved back to the training device (DeepSpeed's).

        Raises:
            OffloadStatesError: the engine has no optimizer.
            ConfigError: ZeRO stage 0.
        """
        self._optimizer_with_states().reload_states(non_blocking=non_blocking)

    # Refusals while states are offloaded, made before the engine counts anything (a script that
    # catches one, reloads and calls again finds the accumulation window as it was).
    def _refuse(self, what: str, kinds: Iterable[StateKind] | None = None) -> None:
        optimizer = self.optimizer
        if isinstance(optimizer, OptimizerStateOffload):
            optimizer._refuse_while_offloaded(what, kinds)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Refused at stages 1-2 while the parameters are offloaded (they are the module's own tensors)."""
        if self.optimizer.coordinator is None:
            self._refuse("engine(...) (forward)", (StateKind.PARAMETERS,))
        return super().forward(*args, **kwargs)  # type: ignore[misc]

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Refused while the gradient buffers are offloaded (backward writes there)."""
        self._refuse("engine.backward()", (StateKind.GRADIENTS, StateKind.GRAD_BUFFERS))
        return super().backward(loss, retain_graph, scale_wrt_gas)  # type: ignore[misc,no-any-return]

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """At an accumulation boundary, refused while any state is offloaded (the optimizer steps there)."""
        if self.window.is_boundary() and not self.window.no_sync:
            self._refuse("engine.step()")
        super().step(lr_kwargs)  # type: ignore[misc]


def get_state_devices(model: Any, state: Any) -> set[torch.device]:
    """DeepSpeed's ``deepspeed.runtime.zero.offload_states.get_state_devices``: the devices ``state``
    (an :class:`OffloadStateTypeEnum`) of the engine ``model`` is on now; empty when nothing of it is in
    memory (``contiguous_grad_buffer`` always: zeroshard frees the reduce buckets after each backward)."""
    optimizer = model.optimizer
    if not isinstance(optimizer, OptimizerStateOffload):
        raise TypeError(f"get_state_devices() needs an engine initialize() built, not {type(model).__name__}")
    return optimizer.state_mover.devices(KINDS[OffloadStateTypeEnum(state)])
