"""``zeroshard.zero``: ZeRO-3 helpers with DeepSpeed's names (``GatheredParameters``, ``Init``,
``register_external_parameter``)."""

from zeroshard.zero.external import register_external_parameter, unregister_external_parameter
from zeroshard.zero.gathered import GatheredParameters
from zeroshard.zero.init import Init
from zeroshard.zero.load import load_weights

__all__ = ["GatheredParameters", "Init", "load_weights", "register_external_parameter", "unregister_external_parameter"]
