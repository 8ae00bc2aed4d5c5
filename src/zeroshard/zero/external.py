"""``zero.register_external_parameter``: a module reads a parameter that another module owns.

Under ZeRO-3 a module's forward gathers the units of its *own* parameters. A forward that reads
another module's parameter (a tied weight, a shared embedding) gathers it on that read
(:mod:`zeroshard.core.zero3.param_reads`, as DeepSpeed does), so registering is not needed; DeepSpeed's
explicit API is kept with its signature for scripts and models that call it
(``register_external_parameter(module, parameter)`` in the module's ``__init__``). A forward
pre-hook on ``module`` then gathers ``parameter``'s unit through the ZeRO-3 coordinator and keeps
it for the pass: the unit stays pinned until backward has finished with it (its gradients are
complete) or the pass ends; in a forward without gradients it is unpinned right after the
module's forward. Before ``initialize`` and at stages 0-2 the hooks do nothing.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from zeroshard.core.seam import coordinator_of, owner_of, unit_of

__all__ = ["add_external_parameters_accessor", "register_external_parameter", "unregister_external_parameter"]

_ATTR = "_zeroshard_external_params"


def _coordinator_and_unit(param: torch.nn.Parameter) -> tuple[Any, Any]:
    owner = owner_of(param)
    return coordinator_of(owner), unit_of(param)


def _units(module: torch.nn.Module) -> list[tuple[Any, Any]]:
    pairs = [_coordinator_and_unit(p) for p in getattr(module, _ATTR, [])]
    return [(c, u) for c, u in pairs if c is not None and u is not None]


def _pre_forward(module: torch.nn.Module, args: Any) -> None:
    for coordinator, unit in _units(module):
        coordinator.fetch([unit], record=False)  # not part of the module trace


def _post_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
    if torch.is_grad_enabled():
        return  # backward reads the parameter again: the pin goes with its gradients or the pass
    for coordinator, unit in _units(module):
        coordinator.module_backward_done([unit])


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Make ``parameter`` available (gathered) whenever ``module``'s forward runs (DeepSpeed's API).

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` or ``parameter`` not an ``nn.Parameter``.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"register_external_parameter: module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError("register_external_parameter: parameter must be a torch.nn.Parameter, got "
                        f"{type(parameter).__name__}")
    registered: list[torch.nn.Parameter] | None = module.__dict__.get(_ATTR)
    if registered is None:
        registered = []
        module.__dict__[_ATTR] = registered
        module.register_forward_pre_hook(_pre_forward)
        module.register_forward_hook(_post_forward)
    if not any(p is parameter for p in registered):
        registered.append(parameter)


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Undo :func:`register_external_parameter` (DeepSpeed's API).

    Raises:
        ValueError: ``parameter`` was not registered with ``module``.
    """
    registered: list[torch.nn.Parameter] = module.__dict__.get(_ATTR, [])
    for i, p in enumerate(registered):
        if p is parameter:
            del registered[i]
            return
    raise ValueError("unregister_external_parameter: the parameter is not registered with this module")


def _external_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(str(i), p) for i, p in enumerate(module.__dict__.get(_ATTR, []))]


def add_external_parameters_accessor(model: torch.nn.Module) -> None:
    """Give every module DeepSpeed's ``ds_external_parameters()``: ``(name, parameter)`` pairs of the
    parameters registered on it (TRL lists a ZeRO-3 model's parameters with it)."""
    for m in model.modules():
        # a partial of a module-level function, not a lambda: the module still pickles
        m.ds_external_parameters = functools.partial(_external_parameters, m)  # type: ignore[assignment]
