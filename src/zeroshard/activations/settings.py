"""Activation-checkpointing settings: DeepSpeed's ``configure()`` / ``is_configured()`` and the
``activation_checkpointing`` config block, resolved into one frozen :class:`Settings`.

DeepSpeed's API is process-wide (``deepspeed.checkpointing.checkpoint(fn, *args)`` takes no
config), so the settings live in one module-level holder, replaced as a whole by
:func:`configure`; nothing else in zeroshard reads or writes it. Neighbours: ``storage.py`` packs
the checkpointed inputs as the settings say, ``function.py`` runs the checkpoint.

Which configuration wins: an explicit :func:`configure` call (Megatron calls it before
``deepspeed.initialize``) is never overridden by ``initialize``; otherwise ``initialize`` applies
its config's ``activation_checkpointing`` block (:func:`configure_from_initialize`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from pydantic import ValidationError

from zeroshard.config.blocks import ActivationCheckpointingConfig
from zeroshard.errors import ConfigError

__all__ = ["Settings", "configure", "configure_from_initialize", "current", "is_configured",
           "partition_activations_in_checkpoint", "set_num_layers", "unconfigure"]

logger = logging.getLogger("zeroshard")


@dataclass(frozen=True)
class Settings:
    """What :func:`~zeroshard.activations.checkpoint` does with each checkpointed region."""

    partition_activations: bool = False
    """Keep 1/N of each checkpointed input on each rank of ``group``; all-gather it at recomputation."""
    cpu_checkpointing: bool = False
    """Keep the checkpointed inputs (or their partitions) in host memory until recomputation."""
    contiguous_memory_optimization: bool = False
    """Accepted without effect: torch's caching allocator already reuses the freed blocks."""
    number_checkpoints: int | None = None
    """Accepted without effect: it only sizes DeepSpeed's contiguous buffer."""
    synchronize: bool = False
    """Synchronize the device at the start and end of each checkpointed forward and recomputation."""
    profile: bool = False
    """Time each checkpointed forward and recomputation and log it (logger ``zeroshard``)."""
    group: dist.ProcessGroup | None = None
    """Model-parallel group the inputs are partitioned over (from the ``mpu``); ``None``: none."""
    mp_rank: int = 0
    """This rank's index in ``group`` (and the tensor-parallel rank used to seed the RNG tracker)."""
    mp_size: int = 1
    """Ranks in ``group``."""

    @property
    def partitions(self) -> bool:
        """Whether inputs are actually partitioned (asked for, and a group of several ranks)."""
        return self.partition_activations and self.mp_size > 1


class _Holder:
    """The process-wide configuration (see the module docstring for why it is global)."""

    settings = Settings()
    configured = False  # configure() or an initialize() with the block was called: is_configured()
    explicit = False  # the user called configure(): initialize() leaves it alone
    mpu: Any = None  # kept across configure() calls, as DeepSpeed does
    generation = 0  # bumped by each configure(), so that once-per-configuration checks run again


def current() -> Settings:
    """The settings in force."""
    return _Holder.settings


def generation() -> int:
    """A number that changes at each (re)configuration."""
    return _Holder.generation


def is_configured() -> bool:
    """True once :func:`configure` was called (or ``initialize`` applied an ``activation_checkpointing``
    block), as ``deepspeed.checkpointing.is_configured()``."""
    return _Holder.configured


def unconfigure() -> None:
    """Back to the unconfigured defaults (no mpu), so a later ``initialize`` applies its block again."""
    _Holder.settings, _Holder.configured, _Holder.explicit, _Holder.mpu = Settings(), False, False, None
    _Holder.generation += 1


def _block_from(config: str | os.PathLike[str] | Mapping[str, Any]) -> ActivationCheckpointingConfig:
    """The ``activation_checkpointing`` block of a DeepSpeed config (path, JSON string or dict)."""
    from zeroshard.config.load import read_config
    from zeroshard.config.validation import config_error_from_validation

    raw = read_config(config).get("activation_checkpointing", {})
    try:
        return ActivationCheckpointingConfig.model_validate(raw)
    except ValidationError as exc:
        err = config_error_from_validation(exc, ActivationCheckpointingConfig)
        key = f"activation_checkpointing.{err.key}" if err.key else "activation_checkpointing"
        raise ConfigError(str(err).removeprefix(f"{err.key}: "), key=key) from None


def _mp_group(mpu: Any) -> tuple[dist.ProcessGroup | None, int, int]:
    """The model-parallel group, rank and size of a Megatron-style ``mpu`` (tensor-parallel first)."""
    if mpu is None:
        return None, 0, 1
    for prefix in ("get_tensor_model_parallel", "get_model_parallel"):
        if all(hasattr(mpu, f"{prefix}_{what}") for what in ("group", "rank", "world_size")):
            return (getattr(mpu, f"{prefix}_group")(), int(getattr(mpu, f"{prefix}_rank")()),
                    int(getattr(mpu, f"{prefix}_world_size")()))
    raise ConfigError(f"mpu ({type(mpu).__name__}) has neither get_tensor_model_parallel_group/rank/world_size "
                      "nor get_model_parallel_group/rank/world_size", key="mpu")


def _settings(block: ActivationCheckpointingConfig, mpu: Any) -> Settings:
    group, rank, size = _mp_group(mpu)
    return Settings(partition_activations=block.partition_activations, cpu_checkpointing=block.cpu_checkpointing,
                    contiguous_memory_optimization=block.contiguous_memory_optimization,
                    number_checkpoints=block.number_checkpoints, synchronize=block.synchronize_checkpoint_boundary,
                    profile=block.profile, group=group, mp_rank=rank, mp_size=size)


def _install(settings: Settings, explicit: bool) -> None:
    _Holder.settings, _Holder.configured = settings, True
    _Holder.explicit = _Holder.explicit or explicit
    _Holder.generation += 1
    _note_no_effect(settings)


def _note_no_effect(s: Settings) -> None:
    """Say once per configuration what is accepted but does nothing here, and why."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if not rank0:
        return
    if s.contiguous_memory_optimization or s.number_checkpoints is not None:
        logger.info("zeroshard: activation_checkpointing.contiguous_memory_optimization and number_checkpoints are "
                    "accepted without effect: on an accelerator torch's caching allocator reuses the freed blocks; "
                    "on CPU, inputs copied out of the heap did not lower the peak, glibc's mmap threshold did "
                    "(docs/memory.md)")
    if s.partition_activations and not s.partitions:
        logger.warning("zeroshard: activation_checkpointing.partition_activations has no effect without a "
                       "model-parallel group of several ranks (pass mpu to zeroshard.checkpointing.configure): "
                       "data-parallel ranks hold different activations, so there is nothing they could share; "
                       "the checkpointed inputs are kept whole (DeepSpeed does the same)")


def configure(mpu_: Any = None, deepspeed_config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
              partition_activations: bool | None = None, contiguous_checkpointing: bool | None = None,
              num_checkpoints: int | None = None, checkpoint_in_cpu: bool | None = None,
              synchronize: bool | None = None, profile: bool | None = None) -> None:
    """Configure activation checkpointing, as ``deepspeed.checkpointing.configure``.

    Starts from the defaults, then applies ``deepspeed_config``'s ``activation_checkpointing``
    block, then each keyword that is not ``None``. An explicit call is never overridden by a later
    ``initialize``.

    Args:
        mpu_: a Megatron-style model-parallel unit (``get_[tensor_]model_parallel_group/rank/world_size``);
            its group is the one ``partition_activations`` partitions over. Kept from an earlier call
            when ``None``.
        deepspeed_config: a DeepSpeed config (path, JSON string or dict) whose block is applied.
        partition_activations: partition the checkpointed inputs over the model-parallel group.
        contiguous_checkpointing: accepted without effect (see :class:`Settings`).
        num_checkpoints: accepted without effect (see :class:`Settings`).
        checkpoint_in_cpu: keep the checkpointed inputs in host memory.
        synchronize: synchronize the device at checkpoint boundaries.
        profile: log the time of each checkpointed forward and recomputation.

    Raises:
        ConfigError: the config's block is invalid (naming the key), ``mpu_`` lacks the methods, or
            contiguous checkpointing is asked for without partitioned activations or the number of
            layers (as DeepSpeed refuses).
    """
    if mpu_ is not None:
        _Holder.mpu = mpu_
    block = ActivationCheckpointingConfig() if deepspeed_config is None else _block_from(deepspeed_config)
    overrides = {"partition_activations": partition_activations, "contiguous_memory_optimization":
                 contiguous_checkpointing, "number_checkpoints": num_checkpoints, "cpu_checkpointing":
                 checkpoint_in_cpu, "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    try:
        block = ActivationCheckpointingConfig.model_validate(
            {**block.model_dump(), **{k: v for k, v in overrides.items() if v is not None}})
    except ValidationError as exc:
        raise ConfigError(f"invalid configure() argument: {exc.errors()[0]['msg']}",
                          key=f"activation_checkpointing.{exc.errors()[0]['loc'][0]}") from None
    _refuse_contiguous_alone(block)
    _install(_settings(block, _Holder.mpu), explicit=True)


def _refuse_contiguous_alone(block: ActivationCheckpointingConfig) -> None:
    """What DeepSpeed's ``configure()`` refuses, though zeroshard would ignore the setting: contiguous
    checkpointing without partitioned activations, or without the number of layers (a script that
    works here must work on DeepSpeed). Its ``initialize`` never checks the config block; neither do we."""
    if not block.contiguous_memory_optimization:
        return
    if not block.partition_activations:
        raise ConfigError("contiguous checkpointing is only available with partitioned activations: pass "
                          "partition_activations=True too (DeepSpeed refuses it alone)",
                          key="activation_checkpointing.partition_activations")
    if block.number_checkpoints is None:
        raise ConfigError("contiguous checkpointing needs the number of layers: pass num_checkpoints (or set "
                          "activation_checkpointing.number_checkpoints; DeepSpeed refuses it without)",
                          key="activation_checkpointing.number_checkpoints")


def set_num_layers(nlayers: int) -> None:
    """DeepSpeed's ``set_num_layers``: sets ``number_checkpoints`` (accepted without effect)."""
    _Holder.settings = dataclasses.replace(_Holder.settings, number_checkpoints=nlayers)


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """DeepSpeed's ``partition_activations_in_checkpoint``: switch partitioning on or off."""
    _Holder.settings = dataclasses.replace(_Holder.settings, partition_activations=bool(partition_activation))
    _Holder.generation += 1
    _note_no_effect(_Holder.settings)


def configure_from_initialize(cfg: Any) -> None:
    """``initialize``'s call: apply ``cfg.activation_checkpointing`` unless the user called
    :func:`configure` (an explicit call wins). Without the block the defaults apply, so settings do
    not leak from one engine's config to the next."""
    if _Holder.explicit:
        return
    if "activation_checkpointing" in cfg.model_fields_set:
        _install(_settings(cfg.activation_checkpointing, _Holder.mpu), explicit=False)
    else:
        _Holder.settings, _Holder.configured = Settings(), False
        _Holder.generation += 1
