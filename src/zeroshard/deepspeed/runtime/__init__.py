"""DeepSpeed's ``deepspeed.runtime`` import paths, for scripts written against DeepSpeed.

Only what zeroshard provides under DeepSpeed's module names lives here (today: the ZeRO memory
estimators in :mod:`zeroshard.deepspeed.runtime.zero.stage_1_and_2` and :mod:`zeroshard.deepspeed.runtime.zero.stage3`).
Submodules load on first attribute access, so ``zeroshard.deepspeed.runtime.zero.stage3.X`` works after
``import zeroshard`` alone, as ``deepspeed.runtime.zero.stage3.X`` does after ``import deepspeed``.
"""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name == "zero":
        return importlib.import_module(f"{__name__}.zero")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
