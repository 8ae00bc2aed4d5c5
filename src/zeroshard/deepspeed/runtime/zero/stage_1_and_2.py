"""DeepSpeed's ``deepspeed.runtime.zero.stage_1_and_2`` memory estimators (ZeRO stages 1 and 2).

``from zeroshard.deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_live``
works as it does with DeepSpeed; the implementation is :mod:`zeroshard.estimate.formulas`.
"""

from zeroshard.estimate.formulas import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
)
from zeroshard.estimate.formulas import zero2_model_to_params as model_to_params

__all__ = [
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "model_to_params",
]
