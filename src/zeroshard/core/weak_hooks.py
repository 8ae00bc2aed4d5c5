"""Tensor hooks that do not keep their owner alive.

A parameter's hooks (``register_post_accumulate_grad_hook``, ``register_hook``) are not visited by
Python's cycle collector: a hook that is a bound method of an object which holds the parameter makes
a cycle that is never freed. An engine dropped without ``destroy()`` (what transformers' Trainer, a
hyperparameter search or a notebook does) then kept its whole training state alive, one copy per
trial. These hooks hold their object weakly, and do nothing once it is gone.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch


def weak_method_hook(method: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A hook calling the bound ``method`` while its object lives, without keeping the object alive."""
    ref = weakref.WeakMethod(method)

    def hook(arg: Any) -> Any:
        fn = ref()
        return None if fn is None else fn(arg)

    return hook


def remove_when_collected(owner: object, handles: list[torch.utils.hooks.RemovableHandle]) -> None:
    """Remove ``handles`` from their tensors once ``owner`` is garbage (the list may grow meanwhile),
    so that a model trained on by a later engine does not carry the dead engine's hooks."""
    weakref.finalize(owner, _remove_all, handles).atexit = False  # nothing to tidy in a process ending


def _remove_all(handles: list[torch.utils.hooks.RemovableHandle]) -> None:
    for h in handles:
        h.remove()
    handles.clear()
