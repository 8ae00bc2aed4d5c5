"""DeepSpeed's ``deepspeed.runtime.zero`` import paths, loaded on first use.

The memory estimators (:mod:`.stage_1_and_2`, :mod:`.stage3`), ``unwrap_model_for_generation``
(:mod:`.stage3`), ``TiledLinear`` and ``TiledLinearReturnBias`` (:mod:`.tiling`) and the
``ZeRORuntimeException`` type (:mod:`.utils`).
"""

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = ("stage_1_and_2", "stage3", "tiling", "utils")
#: names of this package that its submodules define
_NAMES = {"unwrap_model_for_generation": "stage3", "TiledLinear": "tiling", "TiledLinearReturnBias": "tiling"}

__all__ = ["TiledLinear", "TiledLinearReturnBias", "unwrap_model_for_generation"]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
