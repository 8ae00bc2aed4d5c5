"""Which modules form ZeRO-3 units: every module with direct parameters, unless marked a leaf.

A leaf module (``set_z3_leaf_modules``, DeepSpeed's name) is gathered as one unit with its whole
subtree, and its children get no hooks of their own: for blocks whose children run in an order
the trace cannot follow, or only on some ranks (a mixture-of-experts block that runs only the
experts its router picked), or to trade memory for fewer collectives. The config's
``zero_optimization.leaf_module`` marks them too, with DeepSpeed's defaults: Hugging Face's
Mixtral, Qwen2-MoE and Qwen3-MoE sparse blocks.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from zeroshard.config.zero import DEFAULT_LEAF_MODULE_CLASSES
from zeroshard.partition import full_numel

logger = logging.getLogger("zeroshard")

#: DeepSpeed's attribute, so a module marked through either library's helpers is a leaf in both
_LEAF_ATTR = "_z3_leaf"


def _qualified_name(module: torch.nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _mark(model: torch.nn.Module, leaf_module_classes: Sequence[type[torch.nn.Module] | str], flag: bool,
          raise_if_not_found: bool) -> list[torch.nn.Module]:
    types = tuple(c for c in leaf_module_classes if isinstance(c, type))
    names = {c for c in leaf_module_classes if isinstance(c, str)}
    bad = [c for c in leaf_module_classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf_module_classes must be module classes or class names, got {bad!r}")
    marked = [m for m in model.modules()
              if isinstance(m, types) or type(m).__name__ in names or _qualified_name(m) in names]
    if not marked and raise_if_not_found:
        raise ValueError(f"no module of the classes {list(leaf_module_classes)!r} in {type(model).__name__}")
    for m in marked:
        setattr(m, _LEAF_ATTR, flag)
    return marked


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Sequence[type[torch.nn.Module] | str],
                        raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Mark every submodule of one of ``leaf_module_classes`` (classes, or class names plain or
    qualified: ``"MixtralSparseMoeBlock"``) as a ZeRO-3 leaf, and return them; a ``ValueError``
    when none matches, unless ``raise_if_not_found`` is false (as DeepSpeed's).

    Call before ``initialize``.
    """
    return _mark(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Sequence[type[torch.nn.Module] | str],
                          raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Undo :func:`set_z3_leaf_modules` for the modules of ``leaf_module_classes``."""
    return _mark(model, leaf_module_classes, False, raise_if_not_found)


def z3_leaf_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is marked a ZeRO-3 leaf (DeepSpeed's name for :func:`is_leaf`)."""
    return is_leaf(module)


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` marked as ZeRO-3 leaves."""
    return [m for m in model.modules() if is_leaf(m)]


def apply_leaf_module_config(model: torch.nn.Module, leaf: Any) -> list[torch.nn.Module]:
    """Mark the leaves the ``zero_optimization.leaf_module`` block names (``leaf.classes``,
    ``leaf.names`` as in ``named_modules()``, ``leaf.name_suffixes``); warn about names and classes
    that match nothing, unless the classes are DeepSpeed's defaults (most models have none of them)."""
    named = dict(model.named_modules())
    marked = {id(m): m for m in _mark(model, leaf.classes, True, raise_if_not_found=False)}
    by_name = [named[n] for n in leaf.names if n in named]
    by_suffix = [m for suffix in leaf.name_suffixes for n, m in named.items() if n.endswith(suffix)]
    for m in by_name + by_suffix:
        setattr(m, _LEAF_ATTR, True)
        marked.setdefault(id(m), m)
    unmatched = ([n for n in leaf.names if n not in named]
                 + [x for x in leaf.name_suffixes if not any(n.endswith(x) for n in named)])
    if unmatched:
        logger.warning("zeroshard: zero_optimization.leaf_module: no module named %s", unmatched)
    if not marked and tuple(leaf.classes) != DEFAULT_LEAF_MODULE_CLASSES:
        logger.warning("zeroshard: zero_optimization.leaf_module: no module of the classes %s", leaf.classes)
    return list(marked.values())


def mark_fine_grained_leaves(model: torch.nn.Module, threshold: int) -> list[torch.nn.Module]:
    """DeepSpeed's ``stage3_module_granularity_threshold``: mark as leaves, parents first, the modules
    whose granularity (elements of their subtree's parameters per layer, the module and its
    descendants with parameters counted as layers) is at most ``threshold``, so that a block of many
    small layers is gathered in one collective instead of one per layer. Containers
    (``ModuleList``...), modules without children and subtrees above 1e9 elements are never marked,
    as in DeepSpeed. ``0`` marks nothing. Returns the modules marked."""
    if threshold <= 0:
        return []
    granularity: dict[int, float] = {}

    def measure(m: torch.nn.Module) -> tuple[int, int]:
        """(layers, elements) of ``m``'s subtree; records ``m``'s granularity."""
        if not any(True for _ in m.parameters()):
            return 0, 0  # no parameters (an activation): not a layer
        own = sum(full_numel(p) for p in m.parameters(recurse=False))
        children = list(m.children())
        if not children:
            return 1, own
        layers, numel = 0, own
        for child in children:
            child_layers, child_numel = measure(child)
            layers, numel = layers + child_layers, numel + child_numel
        if type(m).__name__ in torch.nn.modules.container.__all__:
            return layers, numel
        layers += 1
        if numel <= 1e9:
            granularity[id(m)] = numel // layers
        return layers, numel

    measure(model)
    marked: list[torch.nn.Module] = []

    def mark(m: torch.nn.Module) -> None:
        if not any(True for _ in m.parameters()):
            return
        if granularity.get(id(m), math.inf) <= threshold:
            setattr(m, _LEAF_ATTR, True)
            marked.append(m)
            return
        for child in m.children():
            mark(child)

    mark(model)
    if not marked and granularity:
        logger.warning("zeroshard: zero_optimization.stage3_module_granularity_threshold %d marks no module: the "
                       "smallest granularity is %d", threshold, min(granularity.values()))
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
