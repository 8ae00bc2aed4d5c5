"""``deepspeed.moe.utils``: DeepSpeed's parameter helpers for a model without experts.

zeroshard builds no expert layer (:class:`~zeroshard.deepspeed.moe.layer.MoE` raises), so no
parameter is an expert parameter and these helpers return what DeepSpeed's return for a dense model:
every parameter shared, the optimizer groups unchanged. A parameter that DeepSpeed's expert layers
would have marked (``param.allreduce`` set to False) raises :class:`~zeroshard.errors.NotYetSupportedError`
rather than being counted as dense.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from zeroshard.deepspeed.moe.layer import moe_not_supported

__all__ = ["configure_moe_param_groups", "has_moe_layers", "is_moe_param", "is_moe_param_group",
           "split_params_grads_into_shared_and_expert_params", "split_params_into_different_moe_groups_for_optimizer",
           "split_params_into_shared_and_expert_params"]


def is_moe_param(param: torch.Tensor) -> bool:
    """False: no parameter is an expert parameter under zeroshard.

    Raises:
        NotYetSupportedError: ``param.allreduce`` is False, DeepSpeed's mark of an expert parameter
            (DeepSpeed would keep it out of the data-parallel all-reduce; zeroshard cannot).
    """
    if getattr(param, "allreduce", True) is False:
        raise moe_not_supported("an expert parameter (param.allreduce=False) passed to deepspeed.moe.utils")
    return False


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """``(False, 0)``: no module can hold an MoE layer (building one raises)."""
    return False, 0


def split_params_into_shared_and_expert_params(
        params: Iterable[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(all parameters, [])``: every parameter is shared (checked with :func:`is_moe_param`)."""
    shared = [p for p in params if not is_moe_param(p)]
    return shared, []


def split_params_grads_into_shared_and_expert_params(
        group: Iterable[nn.Parameter]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(the gradients that exist, each in its parameter's dtype, [])``, as DeepSpeed for a dense model."""
    shared = [p.grad.to(p.dtype) for p in group if not is_moe_param(p) and p.grad is not None]
    return shared, []


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any,
                                                         max_group_size: int | float | None = 178956971
                                                         ) -> list[dict[str, Any]]:
    """The optimizer groups as a list (a dict becomes ``[dict]``, a tuple a list), with no expert group added.

    DeepSpeed adds a group per expert-parallel group of the expert parameters it finds; there are none
    (:func:`is_moe_param`), so the groups come back as DeepSpeed returns them for a dense model.

    Raises:
        ValueError: ``param_groups`` is not a dict, a list or a tuple (DeepSpeed's error).
    """
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    for group in param_groups:
        group["params"] = [p for p in group["params"] if not is_moe_param(p)]  # a list, as DeepSpeed leaves it
    return param_groups


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    """``param_group.get("moe", False)``, as DeepSpeed."""
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: list[Any]) -> list[Any]:
    """DeepSpeed's helper for ``initialize(model_parameters=...)``: a list of tensors becomes one group
    named ``dense-params``; a list of groups comes back as a list of groups. No expert group is added."""
    if not isinstance(model_parameters, list):
        raise TypeError(f"model_parameters must be a list, got {type(model_parameters).__name__}")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError("param argument that would be given to the optimizer should be "
                            f"an iterable of Tensors or dicts, but got {type(p)}")
    if model_parameters and isinstance(model_parameters[0], torch.Tensor):
        return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters,
                                                                     "name": "dense-params"})
    if any("moe" in group for group in model_parameters):
        return model_parameters  # DeepSpeed: the groups are already split
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)
