"""``zeroshard.zero``: ZeRO-3 helpers with DeepSpeed's names (``GatheredParameters``, ``Init``)."""

from zeroshard.zero.gathered import GatheredParameters

__all__ = ["GatheredParameters"]
