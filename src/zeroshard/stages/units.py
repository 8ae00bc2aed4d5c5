"""Which modules form ZeRO-3 units: every module with direct parameters, unless marked a leaf.

A leaf module (``set_z3_leaf_modules``, DeepSpeed's name) is gathered as one unit with its whole
subtree, and its children get no hooks of their own: for blocks whose children run in an order
the trace cannot follow (mixture-of-experts routing), or to trade memory for fewer collectives.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

_LEAF_ATTR = "_zeroshard_z3_leaf"


def set_z3_leaf_modules(model: torch.nn.Module,
                        leaf_module_classes: Sequence[type[torch.nn.Module]]) -> list[torch.nn.Module]:
    """Mark every submodule of one of ``leaf_module_classes`` as a ZeRO-3 leaf; returns them.

    Call before ``initialize``.
    """
    marked = [m for m in model.modules() if isinstance(m, tuple(leaf_module_classes))]
    for m in marked:
        setattr(m, _LEAF_ATTR, True)
    return marked


def is_leaf(module: torch.nn.Module) -> bool:
    """Whether ``module`` is gathered as one unit with its subtree."""
    return bool(getattr(module, _LEAF_ATTR, False))


def unit_modules(root: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Modules in registration order, not descending below leaves."""
    stack, seen = [root], set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        yield m
        if not is_leaf(m):
            stack.extend(reversed(list(m.children())))


def unit_groups(root: torch.nn.Module, wanted: set[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """The parameters of ``wanted`` grouped into units, in module order: each unit module's direct
    parameters (a leaf's whole subtree), a shared parameter with the first module that has it."""
    groups: list[list[torch.nn.Parameter]] = []
    seen: set[torch.nn.Parameter] = set()
    for m in unit_modules(root):
        mine = [p for p in m.parameters(recurse=is_leaf(m)) if p in wanted and p not in seen]
        seen.update(mine)
        if mine:
            groups.append(mine)
    return groups
