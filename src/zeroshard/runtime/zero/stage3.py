"""DeepSpeed's ``deepspeed.runtime.zero.stage3`` memory estimators (ZeRO stage 3).

``from zeroshard.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live``
works as it does with DeepSpeed; the implementation is :mod:`zeroshard.estimate.formulas`.
"""

from zeroshard.estimate.formulas import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from zeroshard.estimate.formulas import zero3_model_to_params as model_to_params

__all__ = [
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "model_to_params",
]
