"""DeepSpeed's ``optimizer.parameter_offload`` as TRL drives it around generation.

TRL's generating trainers (GRPO, PPO, online DPO) gather every parameter of a ZeRO-3 model with
``GatheredParameters`` and then, so that generation runs without the per-module hooks, call its
``remove_hooks(model)``: for each ``param.ds_active_sub_modules.clear()`` (parameters from
``module.named_parameters()`` and ``module.ds_external_parameters()``), ``hook.remove()`` for each
of ``forward_hooks`` and ``backward_hooks``, then ``add_hooks(model)``:
``_register_deepspeed_module(module)`` (``_register_hooks_recursively`` before DeepSpeed 0.16.4).
zeroshard had none of these names, so those trainers failed at their first ZeRO-3 rollout with an
``AttributeError``. Here they act on zeroshard's ZeRO-3 hooks: removing detaches the coordinator
from the module, registering attaches it again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from zeroshard.core.zero3.coordinator import ParamCoordinator


class _CoordinatorHooks:
    """One handle for all of the coordinator's module hooks (``remove()``, as a torch handle)."""

    def __init__(self, coordinator: ParamCoordinator) -> None:
        self._coordinator = coordinator

    def remove(self) -> None:
        self._coordinator.remove_hooks()


class ParameterOffload:
    """The hooks surface of DeepSpeed's ``DeepSpeedZeRoOffload`` over a ZeRO-3 coordinator."""

    def __init__(self, coordinator: ParamCoordinator, module: torch.nn.Module) -> None:
        self._coordinator = coordinator
        self.module = module
        #: handles whose ``remove()`` detaches the module hooks (one for all of them)
        self.forward_hooks: list[Any] = [_CoordinatorHooks(coordinator)]
        #: zeroshard's backward gathers hang off forward's outputs: no handles of their own
        self.backward_hooks: list[Any] = []

    def _register_deepspeed_module(self, module: torch.nn.Module) -> None:
        """Attach the hooks again (after the handles were removed), as DeepSpeed's method of this name."""
        if module is not self.module:
            raise ValueError("_register_deepspeed_module: zeroshard re-registers the hooks of the engine's "
                             "own module only")
        self._coordinator.install_hooks()
        self.forward_hooks = [_CoordinatorHooks(self._coordinator)]

    _register_hooks_recursively = _register_deepspeed_module  # DeepSpeed's name before 0.16.4
