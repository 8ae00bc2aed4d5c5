"""Opt-in: make ``import deepspeed`` resolve to zeroshard, for code that drives DeepSpeed itself.

Hugging Face transformers and accelerate call DeepSpeed through their own code (``deepspeed.zero.Init``,
``deepspeed.initialize``, ``engine.backward``...) behind availability gates: ``find_spec("deepspeed")``,
``importlib.metadata.metadata("deepspeed")`` and version comparisons. :func:`enable` puts one finder
first in ``sys.meta_path`` that answers all three:

* **modules**: ``deepspeed`` and the submodules listed in :data:`zeroshard.deepspeed.surface.MODULES`
  become stand-in modules whose attributes are zeroshard's objects (``deepspeed.zero.Init`` is
  ``zeroshard.zero.Init``); any other ``deepspeed.*`` import fails with a ``ModuleNotFoundError``
  that names this layer;
* **metadata**: a distribution named ``deepspeed`` with version :data:`DISTRIBUTION_VERSION`,
  ``0.19.8+zeroshard.<zeroshard version>``: the DeepSpeed release whose API and config schema zeroshard
  follows, with a PEP 440 local label that says it is zeroshard. It passes every version gate of
  transformers 5.24 and accelerate 1.15 (``docs/hf_probe.md`` lists them).

Nothing happens on import of this module. Turn it on before transformers or accelerate are imported
(both decide at import whether DeepSpeed is there)::

    import zeroshard.deepspeed.imports
    zeroshard.deepspeed.imports.enable()
    import transformers

or run a script under it: ``python -m zeroshard.deepspeed.imports [--shadow] train.py ARGS``, or on every
rank with ``zeroshard launch --as-deepspeed`` (``--shadow-deepspeed``) ``train.py ARGS``.

When the real DeepSpeed is importable, :func:`enable` refuses (:class:`DeepSpeedShadowError`) unless
``shadow=True`` says to hide it; :func:`disable` undoes everything :func:`enable` did.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import runpy
import sys
import types
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import zeroshard
from zeroshard.deepspeed.surface import MODULES, DeepSpeedModule
from zeroshard.errors import ConfigError

#: The DeepSpeed release whose API and config schema zeroshard follows.
DEEPSPEED_API_VERSION = "0.19.8"
#: What ``importlib.metadata.version("deepspeed")`` and ``deepspeed.__version__`` report when enabled.
DISTRIBUTION_VERSION = f"{DEEPSPEED_API_VERSION}+zeroshard.{re.sub(r'[^A-Za-z0-9]+', '.', zeroshard.__version__)}"
#: Modules that evaluate DeepSpeed's availability once, when they are imported.
_GATED_AT_IMPORT = ("transformers.integrations.deepspeed", "accelerate.utils")


class DeepSpeedShadowError(ConfigError):
    """The layer would hide a DeepSpeed that is installed or already imported."""


class _Distribution(importlib.metadata.Distribution):
    """Package metadata of the ``deepspeed`` stand-in: a name, a version and a summary, no files."""

    def read_text(self, filename: str) -> str | None:
        if filename in ("METADATA", "PKG-INFO"):
            return (f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {DISTRIBUTION_VERSION}\n"
                    f"Summary: zeroshard {zeroshard.__version__} presenting DeepSpeed's API "
                    f"(zeroshard.deepspeed.imports)\n")
        return None

    def locate_file(self, path: Any) -> Any:
        return os.path.join(os.path.dirname(zeroshard.__file__), str(path))


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = DeepSpeedModule(spec.name, MODULES[spec.name])
        if spec.name == "deepspeed":
            module.__version__ = DISTRIBUTION_VERSION  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: a stand-in resolves its attributes when they are read."""


class _DeepSpeedFinder(importlib.abc.MetaPathFinder):
    """Finds ``deepspeed`` modules and the ``deepspeed`` distribution; first in ``sys.meta_path``."""

    loader = _Loader()

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        if fullname not in MODULES:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: zeroshard.deepspeed.imports presents DeepSpeed's modules, and "
                f"zeroshard has nothing for this one (docs/hf_probe.md lists what it provides)", name=fullname)
        return importlib.machinery.ModuleSpec(fullname, self.loader, is_package=True)

    def find_distributions(self, context: Any = None) -> Iterable[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or re.sub(r"[-_.]+", "-", name).lower() == "deepspeed":
            return [_Distribution()]
        return []


_finder: _DeepSpeedFinder | None = None


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect."""
    return _finder is not None


def enable(shadow: bool = False) -> None:
    """Make ``import deepspeed``, its module spec and its package metadata resolve to zeroshard.

    Call it before anything imports ``deepspeed``, ``transformers`` or ``accelerate``. Calling it again
    while enabled does nothing.

    Args:
        shadow: hide a real DeepSpeed installed in this environment. Without it, an importable
            DeepSpeed is an error, so that the layer never replaces a library silently.

    Raises:
        DeepSpeedShadowError: the real DeepSpeed is importable and ``shadow`` is false, or it is
            already imported (nothing imported before this call can be redirected).
    """
    global _finder
    if _finder is not None:
        return
    loaded = sys.modules.get("deepspeed")
    if loaded is not None:
        raise DeepSpeedShadowError(
            f"the real DeepSpeed is already imported (from {getattr(loaded, '__file__', '?')}); "
            "enable zeroshard.deepspeed.imports before anything imports deepspeed", key="deepspeed")
    real = importlib.util.find_spec("deepspeed")
    if real is not None and not shadow:
        raise DeepSpeedShadowError(
            f"the real DeepSpeed is installed ({real.origin}) and zeroshard.deepspeed.imports would hide it: "
            "call zeroshard.deepspeed.imports.enable(shadow=True) (or run with "
            "`python -m zeroshard.deepspeed.imports --shadow`, `zeroshard launch --shadow-deepspeed`, or "
            "`python -m zeroshard.deepspeed.accelerate_launch --shadow`) to use "
            "zeroshard in its place, or uninstall "
            "deepspeed", key="deepspeed")
    early = [name for name in _GATED_AT_IMPORT if name in sys.modules]
    if early:
        warnings.warn(f"{', '.join(early)} already imported: they checked for DeepSpeed when imported and will "
                      "not see zeroshard; enable zeroshard.deepspeed.imports before importing them", stacklevel=2)
    _finder = _DeepSpeedFinder()
    sys.meta_path.insert(0, _finder)


def disable() -> None:
    """Remove the finder and every ``deepspeed`` stand-in module from ``sys.modules``."""
    global _finder
    if _finder is None:
        return
    while _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder = None
    for name, module in list(sys.modules.items()):
        if isinstance(module, DeepSpeedModule):
            del sys.modules[name]


_USAGE = "usage: python -m zeroshard.deepspeed.imports [--shadow] (SCRIPT | -m MODULE) [ARGS...]"


def main(argv: list[str] | None = None) -> int:
    """Run a script or module with the layer enabled (``python -m zeroshard.deepspeed.imports``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    shadow = bool(args) and args[0] == "--shadow"
    args = args[1:] if shadow else args
    if not args or args[0] in ("-h", "--help") or (args[0] == "-m" and len(args) < 2):
        print(_USAGE, file=sys.stderr)
        return 2
    enable(shadow=shadow)
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))  # as `python SCRIPT` does
        runpy.run_path(args[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    # Run through the imported module, not this __main__ copy, so that enable()'s state is the one
    # that `import zeroshard.deepspeed.imports` sees.
    from zeroshard.deepspeed.imports import main as _main

    sys.exit(_main())
