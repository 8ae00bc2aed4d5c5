"""ZeRO-3 leaf modules chosen by name: DeepSpeed's ``set_z3_leaf_modules_by_name``/``_by_suffix``.

:func:`zeroshard.stages.units.set_z3_leaf_modules` marks leaves by class; these mark them by their
names in ``model.named_modules()``, exactly or by suffix (``"experts"`` matches ``"layers.0.experts"``),
as the config's ``zero_optimization.leaf_module.names``/``name_suffixes`` do. The mark is the one
:func:`~zeroshard.stages.units.z3_leaf_module` reads (DeepSpeed's ``_z3_leaf`` attribute). Call them
before ``initialize``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zeroshard.stages.units import _LEAF_ATTR

__all__ = ["set_z3_leaf_module", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix"]


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
