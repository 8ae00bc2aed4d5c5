"""Keys that DeepSpeed 0.19.8 reads only at some stages or settings, and accepts (ignoring them) elsewhere.

Clients write such blocks whatever the stage: accelerate's ``DeepSpeedPlugin(zero_stage=2,
offload_param_device="cpu")`` puts an ``offload_param`` block into a stage-2 config, and DeepSpeed trains
it, ignoring the block. Refusing it would stop a script that runs on DeepSpeed; silently ignoring it would
break the rule that nothing in a config is dropped unsaid. So each such key is reset to its default here,
with a warning that names it and says why it has no effect, and the loaded config says what will run.

Combinations that DeepSpeed refuses, or that would train differently, stay errors in ``config/load.py``
(the decisions, one by one: ``docs/deepspeed-differences.md``, "Keys outside their stage").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

from zeroshard.config.schema import ZeroshardConfig
from zeroshard.config.zero import OffloadParamConfig, ZeroConfig

__all__ = ["OUT_OF_SCOPE", "OutOfScope", "drop_out_of_scope"]

logger = logging.getLogger("zeroshard")


class OutOfScope(NamedTuple):
    """One key that DeepSpeed accepts and ignores where ``ignored`` holds."""

    key: str
    """Dotted path named in the warning."""
    ignored: Callable[[ZeroConfig], bool]
    """True when the key is set to a non-default value where DeepSpeed does not read it."""
    reason: Callable[[ZeroConfig], str]
    """Why it has no effect, for the warning."""
    reset: Callable[[ZeroConfig], None]
    """Puts the key back to its default, so that the loaded config is what runs."""


def _reset_offload_param(zero: ZeroConfig) -> None:
    zero.offload_param = OffloadParamConfig()


def _set(name: str, value: object) -> Callable[[ZeroConfig], None]:
    return lambda zero: setattr(zero, name, value)


# fmt: off
OUT_OF_SCOPE: tuple[OutOfScope, ...] = (
    OutOfScope(
        "zero_optimization.offload_param",
        lambda z: z.stage != 3 and z.offload_param != OffloadParamConfig(),
        lambda z: f"parameters are offloaded at ZeRO stage 3 only; at stage {z.stage} they stay on the device "
                  "(DeepSpeed reads offload_param at stage 3 only)",
        _reset_offload_param,
    ),
    OutOfScope(
        "zero_optimization.zero_quantized_weights",
        lambda z: z.stage != 3 and z.zero_quantized_weights,
        lambda z: f"qwZ quantizes ZeRO-3's parameter all-gathers; stage {z.stage} gathers no parameters "
                  "(DeepSpeed reads it at stage 3 only)",
        _set("zero_quantized_weights", False),
    ),
    OutOfScope(
        "zero_optimization.zero_hpz_partition_size",
        lambda z: z.stage != 3 and z.zero_hpz_partition_size > 1,
        lambda z: f"hpZ keeps secondary shards of ZeRO-3's parameters; stage {z.stage} has none "
                  "(DeepSpeed reads it at stage 3 only)",
        _set("zero_hpz_partition_size", 1),
    ),
    OutOfScope(
        "zero_optimization.zero_quantized_gradients",
        lambda z: z.stage < 2 and z.zero_quantized_gradients,
        lambda z: f"qgZ quantizes the gradient reduce-scatter of stages 2-3; stage {z.stage} all-reduces "
                  "gradients unquantized (DeepSpeed's stage 0-1 optimizers do not read it)",
        _set("zero_quantized_gradients", False),
    ),
    OutOfScope(
        "zero_optimization.offload_optimizer.ratio",
        lambda z: z.stage == 3 and z.offload_optimizer.device == "nvme" and z.offload_optimizer.ratio < 1.0,
        lambda z: f"ratio {z.offload_optimizer.ratio} splits the optimizer state between the device and host "
                  "memory; with device \"nvme\" zeroshard puts all of it on NVMe (DeepSpeed 0.19.8 swaps every "
                  "sub-group of at least aio.block_size bytes whatever the ratio): the same training",
        lambda z: setattr(z.offload_optimizer, "ratio", 1.0),
    ),
)
"""Checked in order by :func:`drop_out_of_scope`."""
# fmt: on

_warned: set[str] = set()  # once per key and process, as config/no_effect.py does


def drop_out_of_scope(cfg: ZeroshardConfig) -> list[str]:
    """Reset each key of :data:`OUT_OF_SCOPE` that is set where it has no effect, warning once per key.

    Args:
        cfg: a validated config, changed in place.

    Returns:
        The keys reset (warned about or not).
    """
    reset = []
    zero = cfg.zero_optimization
    for row in OUT_OF_SCOPE:
        if not row.ignored(zero):
            continue
        if row.key not in _warned:
            _warned.add(row.key)
            logger.warning("zeroshard: config key '%s' has no effect here and is ignored: %s",
                           row.key, row.reason(zero))
        row.reset(zero)
        reset.append(row.key)
    return reset
