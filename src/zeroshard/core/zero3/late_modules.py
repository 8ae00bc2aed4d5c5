"""ZeRO-3: a submodule attached to an engine's model after ``initialize``.

Adapters, heads and LoRA layers are sometimes added to a model that an engine already manages. Their
parameters belong to no unit: they are not partitioned and not in the optimizer. DeepSpeed runs such
a module's forward (its parameter dict becomes a ``ZeROOrderedDict`` at the next forward) and never
updates its parameters, though they get gradients: a model that silently does not train that part.

zeroshard watches registrations into every module of an engine's model (torch's global module
registration hook, one for the process): a module whose parameters require grad and belong to no
unit is refused where it is attached, with a :class:`~zeroshard.errors.ZeroshardError` naming it
and saying what to do; a module without such parameters (frozen, or parameterless) is accepted and
runs as in DeepSpeed, its parameter dicts made gathering ones. Modules already managed (a wrapper
around a managed submodule, a submodule put back) are accepted as they are.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from torch.nn.modules.module import register_module_module_registration_hook
from torch.utils.hooks import RemovableHandle

from zeroshard.core.seam import unit_of
from zeroshard.errors import ZeroshardError

__all__ = ["LateModuleError", "adopt", "forget"]


class LateModuleError(ZeroshardError):
    """A trainable module was attached to a ZeRO-3 engine's model after ``initialize``."""


class Adopter(Protocol):
    """What the hook asks of the coordinator that manages a model."""

    module: torch.nn.Module

    def adopt_late(self, module: torch.nn.Module) -> None:
        """Make ``module``'s parameter dicts gathering ones (a module without unmanaged trainable parameters)."""


#: every module of a managed model -> its coordinator (weakly both ways: neither keeps the other alive)
_OWNER: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[Any]] = weakref.WeakKeyDictionary()
_handle: RemovableHandle | None = None


def adopt(root: torch.nn.Module, coordinator: Adopter) -> None:
    """Watch registrations into ``root``'s modules on behalf of ``coordinator``."""
    global _handle
    ref = weakref.ref(coordinator)
    for m in root.modules():
        _OWNER[m] = ref
    if _handle is None:
        _handle = register_module_module_registration_hook(_on_register)


def forget(root: torch.nn.Module, coordinator: Adopter) -> None:
    """Stop watching ``root``'s modules for ``coordinator`` (its hooks are removed)."""
    for m in root.modules():
        ref = _OWNER.get(m)
        if ref is not None and ref() is coordinator:
            del _OWNER[m]


def _qualified(root: torch.nn.Module, parent: torch.nn.Module, name: str) -> str:
    for prefix, m in root.named_modules(remove_duplicate=False):
        if m is parent:
            return f"{prefix}.{name}" if prefix else name
    return name


def _on_register(parent: torch.nn.Module, name: str, sub: torch.nn.Module | None) -> None:
    ref = _OWNER.get(parent)
    coordinator = ref() if ref is not None else None
    if coordinator is None or sub is None:
        return None
    own = _OWNER.get(sub)
    if own is not None and own() is coordinator:
        return None  # already managed: put back, or re-registered under another name
    trainable = [n for n, p in sub.named_parameters() if p.requires_grad and unit_of(p) is None]
    if trainable:
        where = _qualified(coordinator.module, parent, name)
        shown = ", ".join(trainable[:4]) + (f" and {len(trainable) - 4} more" if len(trainable) > 4 else "")
        raise LateModuleError(
            f"ZeRO-3: module {where!r} ({type(sub).__name__}) is attached to the engine's model after initialize: "
            f"its parameters that require grad ({shown}) are not partitioned and not in the optimizer, so they "
            "would never train (DeepSpeed runs such a module and leaves it untrained). Add the module to the model "
            "before deepspeed.initialize (build adapters, heads and LoRA layers first), or freeze it "
            "(module.requires_grad_(False)) to run it as a fixed module")
    for m in sub.modules():
        _OWNER[m] = ref  # type: ignore[assignment]
    coordinator.adopt_late(sub)
    return None
