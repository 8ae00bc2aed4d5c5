"""DeepSpeed's ``DeepSpeedConfig`` and ``add_config_arguments``, over zeroshard's config.

``DeepSpeedConfig(path_or_dict)`` loads and validates a config as :func:`~zeroshard.config.load_config`
does (for the current world size) and answers DeepSpeed's attribute names
(``train_batch_size``, ``zero_optimization_stage``, ``fp16_enabled``, ``optimizer_name``...); any other
attribute is read from the :class:`~zeroshard.config.ZeroshardConfig` (``cfg.zero_optimization``...).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

import torch

from zeroshard.config.load import load_config, read_config
from zeroshard.config.schema import ZeroshardConfig
from zeroshard.errors import NotYetSupportedError

__all__ = ["DeepSpeedConfig", "add_config_arguments"]


class DeepSpeedConfig:
    """A validated config under DeepSpeed's attribute names.

    Args:
        config: a path to a JSON file, a JSON string or a dict.
        mpu: model-parallel unit; only None (no model parallelism).
        mesh_device: device mesh; only None.
        world_size: data-parallel ranks for the batch arithmetic (default: the process group's, or 1).

    Raises:
        ConfigError: the config is invalid (the message names the key or the file).
    """

    def __init__(self, config: str | os.PathLike[str] | Mapping[str, Any], mpu: Any = None, mesh_device: Any = None,
                 world_size: int | None = None) -> None:
        if mpu is not None or mesh_device is not None:
            raise NotYetSupportedError("model parallelism (mpu / mesh_device) is not supported", key="mpu")
        if world_size is None:
            import torch.distributed as dist

            world_size = dist.get_world_size() if dist.is_initialized() else 1
        self._param_dict = read_config(config)
        self.world_size = world_size
        self.cfg: ZeroshardConfig = load_config(self._param_dict, world_size=world_size)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "cfg":
            raise AttributeError(name)
        return getattr(self.cfg, name)

    def __repr__(self) -> str:
        return f"DeepSpeedConfig({self._param_dict!r})"

    @property
    def zero_config(self) -> Any:
        """The ``zero_optimization`` block."""
        return self.cfg.zero_optimization

    @property
    def zero_enabled(self) -> bool:
        """ZeRO stage > 0."""
        return self.cfg.zero_stage > 0

    @property
    def zero_optimization_stage(self) -> int:
        """The ZeRO stage."""
        return self.cfg.zero_stage

    @property
    def float16_config(self) -> Any:
        """The ``fp16`` block."""
        return self.cfg.fp16

    @property
    def bfloat16_config(self) -> Any:
        """The ``bf16`` block."""
        return self.cfg.bf16

    @property
    def fp16_enabled(self) -> bool:
        """``fp16.enabled``."""
        return bool(self.cfg.fp16.enabled)

    @property
    def bfloat16_enabled(self) -> bool:
        """``bf16.enabled``."""
        return bool(self.cfg.bf16.enabled)

    @property
    def optimizer_name(self) -> str | None:
        """``optimizer.type`` (None without an optimizer block)."""
        return self.cfg.optimizer.type if self.cfg.optimizer is not None else None

    @property
    def optimizer_params(self) -> dict[str, Any] | None:
        """``optimizer.params``."""
        return dict(self.cfg.optimizer.params) if self.cfg.optimizer is not None else None

    @property
    def scheduler_name(self) -> str | None:
        """``scheduler.type`` (None without a scheduler block)."""
        return self.cfg.scheduler.type if self.cfg.scheduler is not None else None

    @property
    def scheduler_params(self) -> dict[str, Any] | None:
        """``scheduler.params``."""
        return dict(self.cfg.scheduler.params) if self.cfg.scheduler is not None else None

    @property
    def grad_accum_dtype(self) -> torch.dtype:
        """Gradient accumulation dtype (fp32 unless ``data_types.grad_accum_dtype``)."""
        return self.cfg.grad_accum_dtype

    @property
    def checkpoint_config(self) -> Any:
        """The ``checkpoint`` block."""
        return self.cfg.checkpoint

    @property
    def flops_profiler_config(self) -> Any:
        """The ``flops_profiler`` block."""
        return self.cfg.flops_profiler

    @property
    def comms_config(self) -> Any:
        """The ``comms_logger`` block."""
        return self.cfg.comms_logger


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's ``--deepspeed``, ``--deepspeed_config`` (and the deprecated ``--deepscale``,
    ``--deepscale_config``) to ``parser``, in a group named "DeepSpeed", as DeepSpeed does.

    ``initialize(args=args)`` reads ``args.deepspeed_config`` when no ``config=`` is given.
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on the backend)")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated DeepSpeed json configuration file.")
    return parser
