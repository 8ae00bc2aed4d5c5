"""``zeroshard.deepspeed.utils``: helpers under DeepSpeed's ``deepspeed.utils`` names.

``logger`` and ``log_dist`` (:mod:`.logging`), the ``safe_get_full_*``/``safe_set_*``/``safe_get_local_*``
accessors of sharded parameters, gradients and optimizer states (:mod:`.tensor_fragment`),
with ``safe_update_full_grad_vectorized``, ``set_z3_leaf_modules`` (with ``unset_z3_leaf_modules``,
``z3_leaf_module``, ``get_z3_leaf_modules``, and by module name ``set_z3_leaf_modules_by_name``,
``set_z3_leaf_modules_by_suffix``) and ``RepeatingLoader``.
"""

from zeroshard.core.zero3.units import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
)
from zeroshard.deepspeed.utils.logging import log_dist, logger
from zeroshard.deepspeed.utils.repeating_loader import RepeatingLoader
from zeroshard.deepspeed.utils.tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)

__all__ = [
    "RepeatingLoader",
    "get_z3_leaf_modules",
    "log_dist",
    "logger",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]
