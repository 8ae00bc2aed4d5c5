"""``deepspeed.runtime.zero.config`` and ``offload_config``: DeepSpeed's config objects, read from zeroshard's.

Scripts and tests build DeepSpeed's ``DeepSpeedZeroConfig(**zero_optimization)`` to read a block the
way the engine will (``config.prefetch_bucket_size``, ``config.offload_optimizer is None``). Here the
block goes through zeroshard's own loading (aliases, deprecated ``cpu_offload`` switches, validation
naming the key), and the object answers with DeepSpeed's attribute names: its Python names without
the ``stage3_`` prefix, ``None`` for an offload block the config does not give, and ``overlap_comm``
resolved for the stage. Nothing here configures anything: ``initialize`` reads the config itself.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import ValidationError

from zeroshard.config.compat import DEEPSPEED_ONLY
from zeroshard.config.load import normalize_deepspeed_spellings
from zeroshard.config.schema import ZeroshardConfig
from zeroshard.config.validation import config_error_from_validation
from zeroshard.config.zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
from zeroshard.deepspeed.utils.logging import logger

__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig"]

#: DeepSpeed's Python attribute -> zeroshard's field (the JSON key)
_RENAMED = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
}


class DeepSpeedZeroOffloadOptimizerConfig(OffloadOptimizerConfig):
    """DeepSpeed's ``offload_optimizer`` block. ``pipeline_read`` / ``pipeline_write`` are accepted
    (zeroshard's NVMe swapping is always pipelined) and ``pipeline`` says whether either was asked for."""

    pipeline_read: bool = False
    pipeline_write: bool = False

    @property
    def pipeline(self) -> bool:
        """DeepSpeed's: ``pipeline_read or pipeline_write``."""
        return self.pipeline_read or self.pipeline_write


class DeepSpeedZeroOffloadParamConfig(OffloadParamConfig):
    """DeepSpeed's ``offload_param`` block."""


class DeepSpeedZeroConfig:
    """DeepSpeed's ``zero_optimization`` block as an object, built from keyword arguments.

    Raises:
        ConfigError: a key or value zeroshard's config refuses, naming it.
    """

    def __init__(self, **zero: Any) -> None:
        raw = {"zero_optimization": copy.deepcopy(zero)}
        # Keys of DeepSpeed features zeroshard lacks (zero_hpz_partition_size...) are read back as given;
        # initialize is what refuses them when active.
        self._deepspeed_only = {k: raw["zero_optimization"].pop(k) for k in list(zero)
                                if f"zero_optimization.{k}" in DEEPSPEED_ONLY}
        normalize_deepspeed_spellings(raw)  # cpu_offload: true gives an offload_optimizer block
        self._given: dict[str, Any] = copy.deepcopy(raw["zero_optimization"])
        try:  # the block alone, as DeepSpeed's object: no check across blocks or against the stage
            self._zero: ZeroConfig = ZeroshardConfig.model_validate(raw).zero_optimization
        except ValidationError as exc:
            raise config_error_from_validation(exc, ZeroshardConfig) from None
        if self._zero.stage == 3 and self._zero.elastic_checkpoint:  # DeepSpeed's words, which scripts match
            logger.warning("ZeRO-3 elastic checkpointing is deprecated and no longer supported; zeroshard's "
                           "checkpoints reload at any world size and stage without it")

    @property
    def offload_optimizer(self) -> DeepSpeedZeroOffloadOptimizerConfig | None:
        """``None`` unless the block gives one (DeepSpeed's default)."""
        block = self._given.get("offload_optimizer")
        return None if block is None else DeepSpeedZeroOffloadOptimizerConfig(**block)

    @property
    def offload_param(self) -> DeepSpeedZeroOffloadParamConfig | None:
        """``None`` unless the block gives one (DeepSpeed's default)."""
        block = self._given.get("offload_param")
        return None if block is None else DeepSpeedZeroOffloadParamConfig(**block)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._deepspeed_only:
            return self._deepspeed_only[name]
        try:
            return getattr(self._zero, _RENAMED.get(name, name))
        except AttributeError:
            raise AttributeError(f"DeepSpeedZeroConfig has no attribute {name!r} in zeroshard's compatibility "
                                 "layer") from None

    def __repr__(self) -> str:
        return f"DeepSpeedZeroConfig({self._zero!r})"
