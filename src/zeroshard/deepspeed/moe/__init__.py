"""DeepSpeed's ``deepspeed.moe`` names, for scripts that import them: Mixture of Experts is outside
zeroshard's scope.

``deepspeed.moe``, ``deepspeed.moe.layer`` and ``deepspeed.moe.utils`` (through
:mod:`zeroshard.deepspeed.imports`) and ``zeroshard.moe`` (``import zeroshard as deepspeed``) are this
package. Every name imports, so a script that imports them at top level and trains a dense model
runs (DeepSpeedExamples' ``cifar10_deepspeed.py`` imports
``split_params_into_different_moe_groups_for_optimizer`` whether or not it builds experts).
Building an expert layer (:class:`~zeroshard.deepspeed.moe.layer.MoE`) raises
:class:`~zeroshard.errors.NotYetSupportedError`. The parameter helpers of :mod:`.utils` answer for
a model without experts, which is every model zeroshard trains: no parameter is an expert
parameter, and one that DeepSpeed would call one (``param.allreduce`` False, set by DeepSpeed's
expert layers) raises instead of being trained as a dense one.
"""

from __future__ import annotations

from zeroshard.deepspeed.moe import layer, utils
from zeroshard.deepspeed.moe.layer import MoE

__all__ = ["MoE", "layer", "utils"]
