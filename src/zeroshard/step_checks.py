"""Checks the engine makes at each optimizer step, naming the parameters at fault.

- unused parameters (``ignore_unused_parameters: false``): a trainable parameter no rank gave a
  gradient in the window;
- stray gradients: a ``.grad`` left by a backward outside ``engine.backward``;
- parameters unfrozen after ``initialize``, which are not trained (said once).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from zeroshard.core.grad_sync import GradSync
from zeroshard.errors import UnusedParametersError, ZeroshardError

__all__ = ["check_stray_gradients", "check_unused_parameters", "names_of", "warn_unfrozen"]

logger = logging.getLogger("zeroshard")


def check_unused_parameters(module: torch.nn.Module, sync: GradSync) -> None:
    """A trainable parameter that got no gradient on any rank in the window is an error naming it
    (every rank raises: the set is all-reduced)."""
    names = names_of(module, sync.unused_params())
    if not names:
        return
    raise UnusedParametersError(
        f"{len(names)} trainable parameter(s) got no gradient on any rank in this accumulation window: "
        f"{_listed(names, 10)}. Use them in the forward, freeze them (requires_grad=False), or set "
        "ignore_unused_parameters to true", key="zero_optimization.ignore_unused_parameters")


def check_stray_gradients(module: torch.nn.Module, sync: GradSync) -> None:
    """A trained parameter still holding a ``.grad`` at the step: a backward outside
    ``engine.backward`` (``loss.backward()`` called directly, or a backward for another purpose
    that nothing cleared). Stepping without it would drop what the script may mean to train on,
    adding it would train on what it may mean to discard: an error naming the parameter."""
    names = names_of(module, sync.stray_grads())
    if not names:
        return
    raise ZeroshardError(f"engine.step(): {len(names)} trained parameter(s) hold a .grad that no "
                         f"engine.backward() took ({_listed(names, 5)}): a backward ran outside engine.backward(). "
                         "Train with engine.backward(loss) (it scales, accumulates and reduces the gradients), and "
                         "clear the gradients of backward passes made for other purposes (an input gradient, "
                         "another model's loss through this one) with module.zero_grad() or engine.zero_grad()")


def warn_unfrozen(frozen_at_initialize: list[tuple[str, torch.nn.Parameter]], rank: int) -> bool:
    """A parameter frozen when ``initialize`` ran and given ``requires_grad=True`` since (gradual
    unfreezing) is not trained: it has no master weights and no optimizer state. DeepSpeed leaves
    it unchanged without a word; say so, naming it. Returns whether it warned (then the caller
    stops checking)."""
    late = [n for n, p in frozen_at_initialize if p.requires_grad]
    if not late:
        return False
    if rank == 0:
        logger.warning("zeroshard: %d parameter(s) frozen when initialize() ran now require grad (%s); they "
                       "are not trained: the optimizer was built without them. Pass them to initialize() "
                       "trainable (requires_grad=True, e.g. in a param group with lr 0 until they are "
                       "unfrozen), or build the engine again", len(late), _listed(late, 5))
    return True


def names_of(module: torch.nn.Module, params: Iterable[torch.nn.Parameter]) -> list[str]:
    """The module's names of ``params``, in the module's order (for messages)."""
    wanted = set(params)
    return [n for n, p in module.named_parameters() if p in wanted] if wanted else []


def _listed(names: list[str], limit: int) -> str:
    """``names`` for a message: the first ``limit``, then how many more."""
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
