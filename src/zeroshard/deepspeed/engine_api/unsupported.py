"""DeepSpeed engine methods that zeroshard does not have yet: one table, one row per method.

Each name becomes a method (or property) of the engine that raises
:class:`~zeroshard.errors.NotYetSupportedError` naming it and the reason, so a DeepSpeed script
gets a clear error instead of an ``AttributeError``. Delete a row when the method lands.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from zeroshard.errors import NotYetSupportedError

_DATA_EFFICIENCY = "DeepSpeed's data-efficiency library (curriculum learning, random-LTD) is not supported"
_AUTOTUNING = "autotuning is not supported"
_COMPILE = ("DeepCompile is not supported; engine.compile() (plain torch.compile of the module) or torch.compile "
            "before initialize() compiles the model")
_OFFLOAD = ("moving optimizer state and parameters to host memory between training phases is not supported; "
            "zeroshard offloads as the config's offload_optimizer and offload_param blocks say")
_REDUCE = ("DeepSpeed's internal gradient-reduction helpers are not exposed: zeroshard reduces gradients inside "
           "engine.backward()")

NOT_YET_SUPPORTED: dict[str, str] = {
    "set_data_post_process_func": _DATA_EFFICIENCY,
    "set_custom_curriculum_learning_schedule": _DATA_EFFICIENCY,
    "data_efficiency_config": _DATA_EFFICIENCY,
    "data_sampling_config": _DATA_EFFICIENCY,
    "curriculum_learning_config": _DATA_EFFICIENCY,
    "random_ltd_config": _DATA_EFFICIENCY,
    "random_ltd_initialize": _DATA_EFFICIENCY,
    "get_sequence_parallel_group": "sequence parallelism is not supported",
    "tensor_parallel_config": "tensor parallelism (AutoTP) is not supported",
    "autotp_size": "tensor parallelism (AutoTP) is not supported",
    "torch_autocast_lower_precision_safe_modules": "torch_autocast is not supported",
    "autotuning_start_profile_step": _AUTOTUNING,
    "autotuning_end_profile_step": _AUTOTUNING,
    "autotuning_metric_path": _AUTOTUNING,
    "autotuning_model_info_path": _AUTOTUNING,
    "autotuning_metric": _AUTOTUNING,
    "swap_tensor_config": _OFFLOAD,
    "get_optimizer_configuration": ("DeepSpeed's builder of its own fused optimizers is not exposed; the config's "
                                    "optimizer block builds a torch optimizer"),
    "print_forward_breakdown": "DeepSpeed's MoE/ZeRO-3 forward timers are not kept; use wall_clock_breakdown",
    "allreduce_gradients": _REDUCE,
    "allreduce_bucket": _REDUCE,
    "allreduce_and_copy": _REDUCE,
    "allreduce_no_retain": _REDUCE,
    "buffered_allreduce_fallback": _REDUCE,
    "sparse_allreduce_no_retain": "sparse gradients are not supported",
    "sparse_allreduce_bucket": "sparse gradients are not supported",
    "sparse_allreduce": "sparse gradients are not supported",
    "sparse_all_gather": "sparse gradients are not supported",
    "coalesce_grad_reduction": ("coalesce_grad_reduction() is not supported; at ZeRO stage 0 or 1 gradients are "
                                "reduced once per accumulation window already (and no_sync() works)"),
    "scale": ("engine.scale(loss) followed by loss.backward() is not supported: call engine.backward(loss), which "
              "scales the loss and drives the gradient reduction"),
    "clip_fp32_gradients": "gradients are clipped inside engine.step() (gradient_clipping)",
    "load_moe_state_dict": "mixture-of-experts layers are not supported",
    "get_autosp_backend": _COMPILE,
    "get_autotp_backend": _COMPILE,
    "get_deepcompile_backend": _COMPILE,
    "get_deepspeed_compile_backend": _COMPILE,
    "get_compile_time": _COMPILE,
    "register_compile_pass": _COMPILE,
}
"""Method name -> why it is not supported (the error message says both)."""


def _raise(name: str, reason: str) -> NoReturn:
    raise NotYetSupportedError(f"engine.{name}() is not supported: {reason}", key=name)


def unsupported_method(name: str, reason: str) -> Callable[..., Any]:
    """A method that raises :class:`NotYetSupportedError` naming ``name`` and ``reason``."""

    def method(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        _raise(name, reason)

    method.__name__ = name
    method.__doc__ = f"Not supported: {reason}."
    return method


def install(cls: type) -> None:
    """Give ``cls`` one raising method per row of :data:`NOT_YET_SUPPORTED` (our own class, built here)."""
    for name, reason in NOT_YET_SUPPORTED.items():
        if name in cls.__dict__:
            raise TypeError(f"{cls.__name__}.{name} is implemented: delete its row from NOT_YET_SUPPORTED")
        setattr(cls, name, unsupported_method(name, reason))
