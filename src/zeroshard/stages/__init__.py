"""ZeRO stages: compositions of a master shard, gradient sync and a torch optimizer."""

from zeroshard.stages.stage3 import Stage3Optimizer
from zeroshard.stages.zero_optimizer import StageSpec, ZeroOptimizer

__all__ = ["Stage3Optimizer", "StageSpec", "ZeroOptimizer"]
