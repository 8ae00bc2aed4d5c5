"""The table of optimizer types :func:`~zeroshard.optim.build_optimizer` knows, and their keys.

Each supported type lists the torch keyword arguments it accepts from ``optimizer.params`` and the
DeepSpeed-only keys it understands (consumed by the factory, never passed to torch); every key has a
value check. See :mod:`zeroshard.optim.factory` for what each DeepSpeed key means.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zeroshard.optim import _validate as check

# Value checks for every hyperparameter name any supported optimizer takes.
CHECKS: dict[str, Callable[[Any, str], Any]] = {
    **dict.fromkeys(
        (
            "lr",
            "eps",
            "weight_decay",
            "momentum",
            "dampening",
            "alpha",
            "rho",
            "lr_decay",
            "initial_accumulator_value",
            "momentum_decay",
        ),
        check.non_negative,
    ),
    "betas": check.betas,
    **dict.fromkeys(("nesterov", "maximize", "centered", "amsgrad", "decoupled_weight_decay"), check.boolean),
    "foreach": check.optional_boolean,
    "fused": check.optional_boolean,
    # DeepSpeed-only keys.
    "adam_w_mode": check.boolean,
    "torch_adam": check.boolean,
    "bias_correction": check.boolean,
    "fp32_optimizer_states": check.optional_boolean,
    "set_grad_none": check.boolean,
}

# Optimizer-wide DeepSpeed keys: they select the algorithm, so a param group cannot override them.
DS_KEYS = frozenset({"adam_w_mode", "torch_adam", "bias_correction", "fp32_optimizer_states", "set_grad_none"})


def _keys(names: str) -> frozenset[str]:
    return frozenset(names.split())


@dataclass(frozen=True)
class Spec:
    """One supported optimizer type.

    Attributes:
        name: canonical type name (``"AdamW"``); matched case-insensitively.
        keys: torch keyword arguments accepted from the config (and per param group).
        ds_keys: DeepSpeed-only keys accepted from the config.
        fused_devices: device types on which the torch class has a ``fused`` implementation.
    """

    name: str
    keys: frozenset[str]
    ds_keys: frozenset[str] = frozenset()
    fused_devices: frozenset[str] = frozenset()


# Fused kernels: Adam/AdamW/SGD on CPU and CUDA; Adagrad on CPU (CUDA only in recent torch).
_CPU_CUDA = frozenset({"cpu", "cuda"})
_ADAM = _keys("lr betas eps weight_decay amsgrad maximize foreach fused")
SPECS: dict[str, Spec] = {
    spec.name.lower(): spec
    for spec in (
        Spec("Adam", _ADAM, DS_KEYS, fused_devices=_CPU_CUDA),
        Spec("AdamW", _ADAM, DS_KEYS, fused_devices=_CPU_CUDA),
        Spec(
            "SGD",
            _keys("lr momentum dampening weight_decay nesterov maximize foreach fused"),
            fused_devices=_CPU_CUDA,
        ),
        Spec(
            "Adagrad",
            _keys("lr lr_decay weight_decay initial_accumulator_value eps maximize foreach fused"),
            _keys("fp32_optimizer_states"),
            fused_devices=frozenset({"cpu"}),
        ),
        Spec("Lion", _keys("lr betas weight_decay"), _keys("fp32_optimizer_states set_grad_none")),
        Spec("RMSprop", _keys("lr alpha eps weight_decay momentum centered maximize foreach")),
        Spec("Adamax", _keys("lr betas eps weight_decay maximize foreach")),
        Spec("NAdam", _keys("lr betas eps weight_decay momentum_decay decoupled_weight_decay maximize foreach")),
        Spec("RAdam", _keys("lr betas eps weight_decay decoupled_weight_decay maximize foreach")),
        Spec("Adadelta", _keys("lr rho eps weight_decay maximize foreach")),
    )
}

# Known to DeepSpeed or torch, but not built by zeroshard (yet): not elementwise (so not exact on
# ZeRO shards), or only available as a compiled DeepSpeed op or from ``mup``.
NOT_YET = {
    name.lower(): name
    for name in (
        "Lamb Muon MuAdam MuAdamW MuSGD OneBitAdam ZeroOneAdam OneBitLamb Adafactor LBFGS SparseAdam ASGD Rprop"
    ).split()
}
