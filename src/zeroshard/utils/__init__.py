"""``zeroshard.utils``: helpers under DeepSpeed's ``deepspeed.utils`` names."""

from zeroshard.stages.units import set_z3_leaf_modules

__all__ = ["set_z3_leaf_modules"]
