"""DeepSpeed's ``deepspeed.runtime.zero`` import paths (the memory estimators), loaded on first use."""

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = ("stage_1_and_2", "stage3")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
