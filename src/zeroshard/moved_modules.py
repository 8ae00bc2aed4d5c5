"""Module paths that moved, still importable and runnable (``python -m``) under their old names.

A path the documentation gave keeps working for at least one more release: scripts, launch lines and
``sitecustomize`` files written against a release must not break on the next. The move of DeepSpeed's
names into ``zeroshard.deepspeed`` (2026-12-06) changed module paths users had been told to type, for
example ``python -m zeroshard.compat.deepspeed train.py`` and ``zeroshard.compat.deepspeed.enable()``.

:func:`install` (called by ``import zeroshard``) puts one finder in ``sys.meta_path`` that answers for the
old names of :data:`MOVED` only: importing one returns the module at its new path, the same object (so
``enable()`` through the old name turns on the one import layer), and ``python -m OLD`` runs the new
module's code as ``__main__``. A deprecated name warns once, with :class:`ZeroshardDeprecationWarning`
(a ``DeprecationWarning`` shown by default) naming the new path. ``zeroshard.comm``, ``zeroshard.utils``,
``zeroshard.checkpointing``, ``zeroshard.runtime`` and ``zeroshard.accelerator`` are current public
spellings (attributes of ``zeroshard``): importing them as modules works too, without a warning.

The list and the release each will be removed in: ``docs/deprecations.md``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Sequence

__all__ = ["MOVED", "REMOVED_IN", "ZeroshardDeprecationWarning", "install", "new_name"]

#: The release after which the deprecated names below stop working.
REMOVED_IN = "0.3"

#: Old module path (and, as a prefix, its submodules) -> (new path, deprecated). Longest prefix wins.
MOVED: dict[str, tuple[str, bool]] = {
    "zeroshard.compat.deepspeed": ("zeroshard.deepspeed.imports", True),
    "zeroshard.compat.accelerate_launch": ("zeroshard.deepspeed.accelerate_launch", True),
    "zeroshard.compat.ds_misc": ("zeroshard.deepspeed.misc", True),
    "zeroshard.compat.ds_moe": ("zeroshard.deepspeed.moe", True),
    "zeroshard.compat.ds_op_builder": ("zeroshard.deepspeed.op_builder", True),
    "zeroshard.compat.ds_ops": ("zeroshard.deepspeed.ops", True),
    "zeroshard.compat.ds_param_offload": ("zeroshard.deepspeed.param_offload", True),
    "zeroshard.compat.ds_pipe": ("zeroshard.deepspeed.pipe", True),
    "zeroshard.compat.ds_stage_classes": ("zeroshard.deepspeed.stage_classes", True),
    "zeroshard.compat.ds_surface": ("zeroshard.deepspeed.surface", True),
    "zeroshard.compat.ds_version_info": ("zeroshard.deepspeed.version_info", True),
    "zeroshard.compat.ds_zero_config": ("zeroshard.deepspeed.zero_config", True),
    "zeroshard.monitor.ds_timers": ("zeroshard.deepspeed.timers", True),
    "zeroshard.zero.param_attrs": ("zeroshard.deepspeed.param_attrs", True),
    "zeroshard.engine_api": ("zeroshard.deepspeed.engine_api", True),
    # current public spellings (lazy attributes of zeroshard), importable as modules as before the move
    "zeroshard.checkpointing": ("zeroshard.deepspeed.checkpointing", False),
    "zeroshard.comm": ("zeroshard.deepspeed.comm", False),
    "zeroshard.utils": ("zeroshard.deepspeed.utils", False),
    "zeroshard.runtime": ("zeroshard.deepspeed.runtime", False),
    "zeroshard.accelerator": ("zeroshard.deepspeed.accelerator", False),
}

_PLACEHOLDER_PACKAGES = ("zeroshard.compat",)
"""Old packages with no single new counterpart: an empty package, so that their children import."""


class ZeroshardDeprecationWarning(DeprecationWarning):
    """A zeroshard name that still works and will be removed; shown by default (a filter at install)."""


def new_name(name: str) -> tuple[str, bool] | None:
    """The new module path for an old one, and whether the old one is deprecated; None if it did not move."""
    for old in sorted(MOVED, key=len, reverse=True):
        if name == old or name.startswith(old + "."):
            new, deprecated = MOVED[old]
            return new + name[len(old):], deprecated
    return None


_warned: set[str] = set()


def _warn(old: str, new: str) -> None:
    if old in _warned:
        return
    _warned.add(old)
    # stacklevel 3: past this function and the loader, to the import statement (import machinery frames
    # are skipped by the warnings module)
    warnings.warn(f"'{old}' is deprecated and will be removed after zeroshard {REMOVED_IN}: use '{new}' "
                  "(docs/deprecations.md)", ZeroshardDeprecationWarning, stacklevel=3)


class _AliasLoader(importlib.abc.Loader):
    """Loads an old name as the module at its new path (the same object), or runs its code for ``-m``."""

    def __init__(self, old: str, new: str, deprecated: bool) -> None:
        self.old, self.new, self.deprecated = old, new, deprecated
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if self.deprecated:
            _warn(self.old, self.new)
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # the new module ran when it was imported; the import system has just set its __spec__ to the old
        # name's: give it back, so that the module still says where it lives (reload, inspect, runpy)
        module.__spec__ = self._spec

    def get_code(self, fullname: str) -> types.CodeType | None:
        """What runpy executes for ``python -m OLD``: the new module's code, run as ``__main__``."""
        if self.deprecated:
            _warn(self.old, self.new)
        spec = importlib.util.find_spec(self.new)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "get_code"):
            raise ImportError(f"cannot run '{self.old}': '{self.new}' has no code to run", name=self.old)
        code: types.CodeType | None = loader.get_code(self.new)
        return code

    def is_package(self, fullname: str) -> bool:
        spec = importlib.util.find_spec(self.new)
        return spec is not None and spec.submodule_search_locations is not None


class _PlaceholderLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name, "Moved: see zeroshard.moved_modules and docs/deprecations.md.")
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("zeroshard."):
            return None
        if fullname in _PLACEHOLDER_PACKAGES:
            return importlib.machinery.ModuleSpec(fullname, _PlaceholderLoader(), is_package=True)
        moved = new_name(fullname)
        if moved is None:
            return None
        new, deprecated = moved
        if importlib.util.find_spec(new) is None:
            return None
        loader = _AliasLoader(fullname, new, deprecated)
        return importlib.machinery.ModuleSpec(fullname, loader, is_package=loader.is_package(fullname))


_FINDER = _MovedFinder()


def install() -> None:
    """Answer for the old module names (idempotent); show their deprecation warnings by default."""
    if _FINDER in sys.meta_path:
        return
    sys.meta_path.append(_FINDER)  # after the path finder: a module that exists is never shadowed
    if not sys.warnoptions:  # a user's -W (or PYTHONWARNINGS) decides; else shown, unlike DeprecationWarning
        warnings.filterwarnings("default", category=ZeroshardDeprecationWarning)
