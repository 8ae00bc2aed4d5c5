"""``deepspeed.ops`` optimizers as torch optimizers with DeepSpeed's constructor signatures.

DeepSpeed's ``FusedAdam``, ``DeepSpeedCPUAdam``, ``DeepSpeedCPUAdagrad``, ``FusedLion`` and
``DeepSpeedCPULion`` are compiled kernels of ordinary elementwise updates. zeroshard never builds
compiled ops: these are torch's ``Adam`` (with ``decoupled_weight_decay`` for DeepSpeed's
``adam_w_mode``/``adamw_mode``), torch's ``Adagrad`` and zeroshard's
:class:`~zeroshard.optim.lion.Lion`, using torch's fused CPU/CUDA kernels where they apply (as fast
as DeepSpeed's CPU Adam, see DESIGN.md). accelerate builds ``DeepSpeedCPUAdam`` from a torch
optimizer's param groups when ZeRO-Offload is configured; zeroshard's engine adopts a client
optimizer's param groups, so these classes train under every stage.

Options whose effect torch cannot reproduce are refused, as zeroshard's config path refuses them:
``bias_correction=False`` and ``fp32_optimizer_states=False`` raise ``NotYetSupportedError``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zeroshard.errors import ConfigError, NotYetSupportedError
from zeroshard.optim.factory import implementation_flags
from zeroshard.optim.lion import Lion

_CPU_CUDA = frozenset({"cpu", "cuda"})
Params = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


def _tensors(params: Params) -> tuple[list[Any], list[torch.Tensor]]:
    """The params as a list (an iterator is consumed once) and every tensor in them."""
    items: list[Any] = list(params)
    tensors: list[torch.Tensor] = []
    for item in items:
        tensors += list(item["params"]) if isinstance(item, dict) else [item]
    return items, tensors


def _require(flag: bool, name: str, cls: str) -> None:
    if not flag:
        raise NotYetSupportedError(f"{cls}({name}=False) has no torch equivalent in zeroshard", key=name)


class _DeepSpeedAdam(torch.optim.Adam):
    """Adam or AdamW for the whole optimizer, as DeepSpeed's Adam kernels decide it once."""

    def _setup(self, params: Params, lr: float, betas: tuple[float, float], eps: float,
               weight_decay: float, decoupled: bool) -> None:
        items, tensors = _tensors(params)
        super().__init__(items, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=decoupled, **implementation_flags(tensors, _CPU_CUDA))
        # DeepSpeed's mode is optimizer-wide: param groups copied from a torch Adam/AdamW (as accelerate
        # passes them) must not bring their own.
        for group in self.param_groups:
            group["decoupled_weight_decay"] = decoupled


class FusedAdam(_DeepSpeedAdam):
    """DeepSpeed's ``deepspeed.ops.adam.FusedAdam`` signature; ``set_grad_none`` is accepted, as the
    engine owns gradient zeroing."""

    def __init__(self, params: Params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        if amsgrad:
            raise ConfigError("FusedAdam does not support AMSGrad (DeepSpeed refuses it too)", key="amsgrad")
        _require(bias_correction, "bias_correction", "FusedAdam")
        self._setup(params, lr, betas, eps, weight_decay, adam_w_mode)


class DeepSpeedCPUAdam(_DeepSpeedAdam):
    """DeepSpeed's ``deepspeed.ops.adam.DeepSpeedCPUAdam`` signature (``adamw_mode``, default AdamW)."""

    def __init__(self, model_params: Params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            raise ConfigError("DeepSpeedCPUAdam does not support AMSGrad (DeepSpeed refuses it too)",
                              key="amsgrad")
        _require(bias_correction, "bias_correction", "DeepSpeedCPUAdam")
        _require(fp32_optimizer_states, "fp32_optimizer_states", "DeepSpeedCPUAdam")
        self._setup(model_params, lr, betas, eps, weight_decay, adamw_mode)


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """DeepSpeed's ``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad`` signature."""

    def __init__(self, model_params: Params, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            raise ConfigError("Adagrad has no AMSGrad variant (DeepSpeed ignores the flag; zeroshard refuses it)",
                              key="amsgrad")
        _require(fp32_optimizer_states, "fp32_optimizer_states", "DeepSpeedCPUAdagrad")
        items, tensors = _tensors(model_params)
        super().__init__(items, lr=lr, eps=eps, weight_decay=weight_decay,
                         **implementation_flags(tensors, frozenset({"cpu"})))


class FusedLion(Lion):
    """DeepSpeed's ``deepspeed.ops.lion.FusedLion`` signature (``set_grad_none`` accepted)."""

    def __init__(self, params: Params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, set_grad_none: bool = True) -> None:
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)


class DeepSpeedCPULion(Lion):
    """DeepSpeed's ``deepspeed.ops.lion.DeepSpeedCPULion`` signature."""

    def __init__(self, model_params: Params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0, fp32_optimizer_states: bool = True) -> None:
        _require(fp32_optimizer_states, "fp32_optimizer_states", "DeepSpeedCPULion")
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
