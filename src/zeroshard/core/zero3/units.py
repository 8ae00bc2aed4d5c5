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

import torch

from zeroshard.core.partition import full_numel

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


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    """Mark (``flag`` true) or unmark ``model`` itself as a ZeRO-3 leaf."""
    setattr(model, _LEAF_ATTR, flag)


def set_z3_leaf_modules_by_name(model: torch.nn.Module, module_names: Sequence[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[torch.nn.Module], list[str]]:
    """Set the leaf mark of the submodules named ``module_names`` (as in ``model.named_modules()``;
    ``""`` is ``model``) to ``flag``.

    Returns:
        The modules matched, in the order of ``module_names``, and the names that matched none.

    Raises:
        ValueError: some name matched no module and ``raise_if_not_found`` is true (the names found
            are marked all the same, as DeepSpeed does).
    """
    named = dict(model.named_modules())
    matched: list[torch.nn.Module] = []
    missing: list[str] = []
    for name in module_names:
        module = named.get(name)
        if module is None:
            missing.append(name)
            continue
        set_z3_leaf_module(module, flag)
        matched.append(module)
    if missing and raise_if_not_found:
        raise ValueError(f"no module named {missing} in {type(model).__name__} (names are those of named_modules())")
    return matched, missing


def set_z3_leaf_modules_by_suffix(model: torch.nn.Module, module_name_suffixes: Sequence[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[torch.nn.Module], list[str]]:
    """Set the leaf mark of every submodule whose name in ``model.named_modules()`` ends with one of
    ``module_name_suffixes`` to ``flag``.

    Returns:
        The modules matched (each once, in the order found) and the suffixes that matched none.

    Raises:
        ValueError: some suffix matched no module and ``raise_if_not_found`` is true.
    """
    named = dict(model.named_modules())
    matched: dict[int, torch.nn.Module] = {}
    missing: list[str] = []
    for suffix in module_name_suffixes:
        hits = [module for name, module in named.items() if name.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        for module in hits:
            set_z3_leaf_module(module, flag)
            matched.setdefault(id(module), module)
    if missing and raise_if_not_found:
        raise ValueError(f"no module whose name ends with {missing} in {type(model).__name__}")
    return list(matched.values()), missing


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
