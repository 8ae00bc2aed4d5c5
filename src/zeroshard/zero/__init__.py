"""``zeroshard.zero``: ZeRO-3 helpers with DeepSpeed's names (``GatheredParameters``, ``Init``)."""

from zeroshard.zero.gathered import GatheredParameters
from zeroshard.zero.init import Init

__all__ = ["GatheredParameters", "Init"]
