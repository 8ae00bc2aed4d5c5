"""The optimizer of an engine built without one: DeepSpeed's evaluation and inference engine."""

from __future__ import annotations

from typing import Any

import torch

from zeroshard.errors import ConfigError

__all__ = ["NoOptimizer"]


class NoOptimizer(torch.optim.Optimizer):
    """What an engine built without any optimizer steps with. DeepSpeed builds such an engine for
    evaluation and inference (transformers' ``Trainer.evaluate()`` before any training, at ZeRO-3
    to partition the model); training it is an error naming the cause."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        super().__init__(groups or [{"params": []}], {})  # torch refuses no group; a model frozen whole has none

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        raise ConfigError("engine.step(): this engine was built without an optimizer, for evaluation or "
                          "inference; to train, add an 'optimizer' block to the config or pass "
                          "initialize(optimizer=...)", key="optimizer")
