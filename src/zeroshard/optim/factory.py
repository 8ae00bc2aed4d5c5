"""Build a torch optimizer from a DeepSpeed ``"optimizer"`` config section.

What DeepSpeed 0.19.8 does (``DeepSpeedConfig`` and ``DeepSpeedEngine._configure_basic_optimizer``),
and what zeroshard does with it:

* **Type names.** DeepSpeed lowercases the type only for its own names (``adam``, ``adamw``,
  ``adagrad``, ``lion``, ``lamb``, ``muon``, ...); any other type is looked up as
  ``getattr(torch.optim, type)``, so ``"SGD"`` must be spelled exactly. zeroshard matches every
  type case-insensitively (a superset: every name DeepSpeed accepts is accepted).
* **"Adam" and "AdamW".** Both pop ``adam_w_mode`` (default ``True``); the update is decoupled
  (AdamW) when the type is ``AdamW`` *or* ``adam_w_mode`` is true. So plain ``"Adam"`` is AdamW
  unless ``"adam_w_mode": false`` (then L2 regularisation, i.e. ``torch.optim.Adam``), and
  ``"AdamW"`` is AdamW whatever ``adam_w_mode`` says. Without ``torch_adam`` DeepSpeed builds its
  compiled ``FusedAdam`` (``DeepSpeedCPUAdam`` under ZeRO-Offload) whose defaults are ``lr=1e-3,
  betas=(0.9, 0.999), eps=1e-8, weight_decay=0``; with ``"torch_adam": true`` it builds
  ``torch.optim.AdamW``/``Adam`` directly, whose ``AdamW`` default ``weight_decay`` is ``0.01``.
  zeroshard always builds the torch class (same math as ``FusedAdam``) and reproduces those
  defaults: ``weight_decay`` defaults to 0 except for ``torch_adam`` in AdamW mode.
* **DeepSpeed-only Adam keys**, consumed here and never passed to torch: ``adam_w_mode``,
  ``torch_adam``; ``bias_correction`` (``FusedAdam`` option; only ``true`` exists in torch, so
  ``false`` is not yet supported); ``fp32_optimizer_states`` (CPU-Adam option; zeroshard keeps
  optimizer states in the dtype of the fp32 master params, so ``false`` is not yet supported);
  ``set_grad_none`` (``FusedAdam``/``FusedLion`` ``zero_grad`` option; zeroshard's engine owns
  gradient zeroing, so it is accepted and has no effect).
* **torch-only keys** ``fused`` and ``foreach``: DeepSpeed forwards them only with ``torch_adam``
  (``FusedAdam`` rejects them). zeroshard accepts them for every torch optimizer that has them and
  an explicit value overrides the automatic choice made by :func:`implementation_flags`.
* ``amsgrad``: ``FusedAdam`` raises on it, torch implements it; zeroshard accepts it.
* ``max_grad_norm``: DeepSpeed raises and points at the top-level ``gradient_clipping``; so do we.
* **Lion**: DeepSpeed's compiled ``FusedLion``; zeroshard's :class:`~zeroshard.optim.lion.Lion` is
  the same update in plain torch. **Adagrad, SGD** and the other elementwise torch optimizers are
  built from ``torch.optim`` with the config params as keyword arguments, exactly as DeepSpeed does.
* Optimizers that are not elementwise (``Lamb``, ``Muon``, ``Adafactor``, ``LBFGS``...) or that need
  DeepSpeed's compiled ops or ``mup`` are not supported yet: ``NotYetSupportedError``.
* Empty param groups are dropped, as DeepSpeed's ``_configure_optimizer`` drops them.
"""

from __future__ import annotations

from typing import Any

import torch

from zeroshard.errors import ConfigError, NotYetSupportedError
from zeroshard.optim import _validate as check
from zeroshard.optim._specs import CHECKS, DS_KEYS, NOT_YET, SPECS, Spec
from zeroshard.optim.lion import Lion

_P = "optimizer.params"

SUPPORTED_OPTIMIZERS: tuple[str, ...] = tuple(spec.name for spec in SPECS.values())
"""Optimizer ``type`` names :func:`build_optimizer` accepts (matched case-insensitively)."""

_FUSED_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})


def implementation_flags(params: list[torch.Tensor], fused_devices: frozenset[str]) -> dict[str, bool]:
    """Choose torch's fastest implementation for these parameters.

    Left alone, torch picks the single-tensor for-loop on CPU and ``foreach`` on CUDA, and never picks
    ``fused``. The fused kernels (Adam, AdamW, SGD on CPU and CUDA; Adagrad on CPU) do the whole update in one
    pass over memory; on CPU fused Adam is several times faster than ``foreach``. They need plain
    floating-point dense tensors on a supported device, so anything else keeps torch's default.

    Args:
        params: every parameter the optimizer will update.
        fused_devices: device types on which the optimizer class has a ``fused`` implementation.

    Returns:
        ``{"fused": True}`` when the fused kernels apply, else ``{}`` (torch's own default).
    """
    if params and all(
        type(p) in (torch.Tensor, torch.nn.Parameter)
        and p.device.type in fused_devices
        and p.dtype in _FUSED_DTYPES
        and not p.is_sparse
        for p in params
    ):
        return {"fused": True}
    return {}


def _resolve_spec(opt_type: Any) -> Spec:
    if not isinstance(opt_type, str):
        raise ConfigError(f"expected an optimizer name, got {opt_type!r}", key="optimizer.type")
    lowered = opt_type.lower()
    if lowered in SPECS:
        return SPECS[lowered]
    supported = ", ".join(SUPPORTED_OPTIMIZERS)
    if lowered in NOT_YET:
        raise NotYetSupportedError(
            f"optimizer {NOT_YET[lowered]!r} is not supported yet; supported: {supported}",
            key="optimizer.type",
        )
    raise ConfigError(f"unknown optimizer {opt_type!r}; supported: {supported}", key="optimizer.type")


def _check_value(name: str, value: Any, key: str) -> Any:
    if name == "lr" and isinstance(value, torch.Tensor) and value.numel() == 1:
        check.non_negative(value.item(), key)  # torch accepts a tensor LR (fused/capturable); keep it
        return value
    return CHECKS[name](value, key)


def _check_values(values: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {name: _check_value(name, value, f"{prefix}.{name}") for name, value in values.items()}


def _consume_ds_keys(spec: Spec, options: dict[str, Any]) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """Pop the DeepSpeed-only keys from ``options``; return the torch class and extra defaults."""
    adam_w_mode = options.pop("adam_w_mode", True)
    torch_adam = options.pop("torch_adam", False)
    options.pop("set_grad_none", None)
    if options.pop("bias_correction", True) is False:
        raise NotYetSupportedError("bias_correction=false has no torch implementation", key=f"{_P}.bias_correction")
    if options.pop("fp32_optimizer_states", None) is False:
        raise NotYetSupportedError(
            "optimizer states follow the fp32 master parameters; low-precision states are not supported yet",
            key=f"{_P}.fp32_optimizer_states",
        )
    if spec.name == "Lion":
        return Lion, {}
    if spec.name not in ("Adam", "AdamW"):
        return getattr(torch.optim, spec.name), {}
    decoupled = spec.name == "AdamW" or adam_w_mode
    # FusedAdam / DeepSpeedCPUAdam default weight_decay to 0; with torch_adam DeepSpeed calls torch's
    # AdamW, whose default is 0.01 (torch's Adam default is already 0).
    extra = {} if (torch_adam and decoupled) else {"weight_decay": 0.0}
    return (torch.optim.AdamW if decoupled else torch.optim.Adam), extra


def _prepare_groups(param_groups: list[dict[str, Any]], spec: Spec) -> list[dict[str, Any]]:
    """Validate per-group overrides, tuple-ise betas, drop empty groups (as DeepSpeed does)."""
    groups: list[dict[str, Any]] = []
    for index, group in enumerate(param_groups):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"param_groups[{index}] must be a dict with a 'params' list, got {type(group).__name__}")
        prefix = f"param_groups[{index}]"
        for name in group:
            if name in DS_KEYS:
                raise ConfigError(
                    "is an optimizer-wide setting and cannot be set per param group", key=f"{prefix}.{name}"
                )
            if name in CHECKS and name not in spec.keys:
                check.reject_unknown([name], spec.keys, prefix, f"optimizer {spec.name!r}")
        hyper = {k: v for k, v in group.items() if k in spec.keys}
        params = list(group["params"])
        if params:
            groups.append({**group, **_check_values(hyper, prefix), "params": params})
    return groups


def build_optimizer(
    opt_type: str, params: dict[str, Any] | None, param_groups: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    """Build the optimizer a DeepSpeed config describes, with torch's fastest implementation.

    Args:
        opt_type: the config's ``optimizer.type`` (case-insensitive), one of :data:`SUPPORTED_OPTIMIZERS`.
        params: the config's ``optimizer.params`` (may be ``None``); they are the defaults of every group.
        param_groups: dicts with ``"params"`` (a list of tensors) and optional per-group overrides such
            as ``"lr"`` or ``"weight_decay"``; other keys (``"name"``...) are kept on the group, as torch
            keeps them. Empty groups are dropped.

    Returns:
        A ``torch.optim.Optimizer``.

    Raises:
        ConfigError: unknown type (key ``optimizer.type``), unknown or invalid parameter (key
            ``optimizer.params.<name>``), or no parameters at all.
        NotYetSupportedError: a known type or option value zeroshard does not implement yet.
    """
    spec = _resolve_spec(opt_type)
    options = dict(params or {})
    if "max_grad_norm" in options:
        raise ConfigError(
            "is not an optimizer parameter; use the top-level 'gradient_clipping' instead",
            key=f"{_P}.max_grad_norm",
        )
    check.reject_unknown(options, spec.keys | spec.ds_keys, _P, f"optimizer {spec.name!r}")
    options = _check_values(options, _P)
    cls, extra = _consume_ds_keys(spec, options)
    options = {**extra, **options}
    if options.get("nesterov") and (options.get("momentum", 0.0) <= 0.0 or options.get("dampening", 0.0) != 0.0):
        raise ConfigError("nesterov needs momentum > 0 and dampening == 0", key=f"{_P}.nesterov")

    groups = _prepare_groups(param_groups, spec)
    all_params = [p for group in groups for p in group["params"]]
    if not all_params:
        raise ConfigError("the optimizer was given no parameters (every param group is empty)")
    if "fused" not in options and "foreach" not in options:
        options.update(implementation_flags(all_params, spec.fused_devices))
    try:
        return cls(groups, **options)
    except ValueError as err:  # torch's own checks, e.g. a parameter in two groups, a bad group value
        raise ConfigError(f"torch.optim rejected the optimizer setup: {err}") from err
