"""Loading a DeepSpeed-style JSON config: parsing, aliases, ``"auto"`` values, validation, batch arithmetic,
cross-key checks and the not-yet-supported check.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from zeroshard.config.autos import check_auto_values_agree, normalize_auto_values, resolve_autos
from zeroshard.config.batch import resolve_batch_sizes
from zeroshard.config.compat import (
    convert_deprecated_offload,
    drop_dotted_keys,
    normalize_aliases,
    reject_deepspeed_only,
)
from zeroshard.config.schema import ZeroshardConfig
from zeroshard.config.stage_scope import drop_out_of_scope
from zeroshard.config.support import check_supported
from zeroshard.config.validation import check_json_data, config_error_from_validation
from zeroshard.errors import ConfigError

__all__ = ["ConfigSource", "load_config", "read_config", "to_dict"]

ConfigSource = str | os.PathLike[str] | Mapping[str, Any] | ZeroshardConfig
"""What :func:`load_config` accepts: a JSON file path, a JSON string, a dict, or a ZeroshardConfig."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _parse_json(text: str, origin: str) -> dict[str, Any]:
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{origin} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from exc
    except ValueError as exc:  # duplicate key, integer of more than 4300 digits
        raise ConfigError(f"{origin} is not a valid config: {exc}") from exc
    except RecursionError:
        raise ConfigError(f"{origin} is not a valid config: nested too deeply") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{origin} must contain a JSON object, got {type(data).__name__}")
    check_json_data(data)  # nesting depth
    return data


def read_config(config: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """Return the raw config dict from a path, a JSON string or a mapping (which is deep-copied).

    Args:
        config: a path to a JSON file, a JSON object as a string (stripped form starts with ``{``), or a
            mapping.

    Returns:
        A fresh dict that the caller may modify.

    Raises:
        ConfigError: the file is missing or unreadable, or the JSON is invalid (the message names the file
            and the error position); a mapping holds what JSON cannot (objects, non-string keys, a cycle).
    """
    if isinstance(config, Mapping):
        check_json_data(config)
        return copy.deepcopy(dict(config))
    if isinstance(config, str) and config.strip().startswith("{"):
        return _parse_json(config, "the config JSON string")
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(
            f"config must be a path, a JSON string, a dict or a ZeroshardConfig, got {type(config).__name__}"
        )
    path = Path(config)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ConfigError(f"config file '{path}' does not exist") from exc
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, or a NUL byte in the path
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc}") from exc
    return _parse_json(text, f"config file '{path}'")


def _check_consistency(cfg: ZeroshardConfig) -> None:
    """Cross-key checks that a single field's validation cannot express.

    Each refusal here is one DeepSpeed 0.19.8 makes too, or a config it would fail on at run time, or one of
    zeroshard's own keys; a key DeepSpeed accepts and ignores at this stage is reset with a warning by
    :func:`zeroshard.config.stage_scope.drop_out_of_scope` instead.
    """
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError("fp16.enabled and bf16.enabled are both true; enable at most one", key=None)
    if cfg.bf16.enabled and not cfg.bf16.check_grad_overflow and cfg.non_finite_gradients == "raise":
        raise ConfigError("bf16.check_grad_overflow false applies steps with NaN or Inf gradients, and "
                          "non_finite_gradients 'raise' stops at them: choose one", key="bf16.check_grad_overflow")
    zero = cfg.zero_optimization
    if cfg.gradient_allreduce_op == "sum" and zero.stage == 3:
        raise ConfigError("gradient_allreduce_op 'sum' is not supported with ZeRO stage 3 (as in DeepSpeed): "
                          "use 'mean', or stage 0-2", key="gradient_allreduce_op")
    if zero.offload_optimizer.ratio < 1.0 and zero.stage != 3:
        raise ConfigError(
            f"partial optimizer offload (ratio {zero.offload_optimizer.ratio}) requires ZeRO stage 3, "
            f"not stage {zero.stage} (as in DeepSpeed)",
            key="zero_optimization.offload_optimizer.ratio",
        )
    if zero.offload_optimizer.device != "none" and zero.stage == 0:
        # DeepSpeed 0.19.8 accepts this config and builds its CPU Adam over the device's parameters, which
        # fails at the first step on a GPU: an error now is kinder than one at step 1.
        raise ConfigError("optimizer offload needs ZeRO stage 1, 2 or 3 (stage 0 keeps the whole optimizer "
                          "state on every rank)", key="zero_optimization.offload_optimizer.device")
    if zero.hybrid_shard_size and zero.stage == 0:
        raise ConfigError(f"hybrid_shard_size {zero.hybrid_shard_size} shards the training state inside groups of "
                          "ranks: it needs ZeRO stage 1, 2 or 3 (stage 0 replicates everything)",
                          key="zero_optimization.hybrid_shard_size")
    if zero.hybrid_shard_size and zero.zero_hpz_partition_size > 1:
        raise ConfigError("hybrid_shard_size and zero_hpz_partition_size together are not supported yet: "
                          "choose one", key="zero_optimization.hybrid_shard_size")
    for name, block in (("offload_optimizer", zero.offload_optimizer), ("offload_param", zero.offload_param)):
        if block.device == "nvme" and block.nvme_path is None:
            raise ConfigError(
                f'device "nvme" requires zero_optimization.{name}.nvme_path',
                key=f"zero_optimization.{name}.nvme_path",
            )


def normalize_deepspeed_spellings(raw: dict[str, Any]) -> None:
    """DeepSpeed's other spellings of a config, in place: dotted top-level keys dropped (with a
    warning), aliases renamed, deprecated offload switches turned into blocks, and DeepSpeed-only
    keys at their "off" values dropped (active ones refused: ``NotYetSupportedError``)."""
    drop_dotted_keys(raw, ZeroshardConfig)
    normalize_aliases(raw)
    convert_deprecated_offload(raw)
    reject_deepspeed_only(raw)


def load_config(
    config: ConfigSource,
    world_size: int,
    auto_values: Mapping[str, Any] | None = None,
    *,
    check_support: bool = True,
) -> ZeroshardConfig:
    """Load, validate and resolve a DeepSpeed-style config for ``world_size`` data-parallel ranks.

    Args:
        config: a path (str or os.PathLike) to a JSON file, a JSON object as a string, a dict, or a
            ZeroshardConfig (validated and resolved again; a config already resolved for another world
            size fails the batch arithmetic, since all three batch sizes are then set).
        world_size: number of data-parallel ranks.
        auto_values: values for keys that are ``"auto"`` in the config, keyed by dotted path (e.g.
            ``{"optimizer.params.lr": 1e-4}``). An entry for a key that is not ``"auto"`` must equal the
            config's value.
        check_support: raise NotYetSupportedError for features listed in
            :data:`zeroshard.config.support.NOT_YET_SUPPORTED` (tests may pass False).

    Returns:
        The resolved config; its three batch-size fields are ints.

    Raises:
        ConfigError: the config is invalid; ``.key`` names the offending dotted key path when there is one.
        NotYetSupportedError: the config uses a feature zeroshard does not support yet.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(config, ZeroshardConfig):
        raw = config.model_dump()
    else:
        raw = read_config(config)
    normalize_deepspeed_spellings(raw)
    autos = normalize_auto_values(ZeroshardConfig, auto_values)
    auto_keys, batch_autos = resolve_autos(raw, ZeroshardConfig, autos)
    try:
        cfg = ZeroshardConfig.model_validate(raw)
    except ValidationError as exc:
        raise config_error_from_validation(exc, ZeroshardConfig) from None
    tbs, micro, gas = resolve_batch_sizes(
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
        world_size,
        batch_autos,
    )
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = (
        tbs,
        micro,
        gas,
    )
    drop_out_of_scope(cfg)
    _check_consistency(cfg)
    check_auto_values_agree(to_dict(cfg), autos, auto_keys)
    if check_support:
        check_supported(cfg)
    return cfg


def to_dict(cfg: ZeroshardConfig) -> dict[str, Any]:
    """Return the config as a JSON-serializable dict with DeepSpeed key names.

    Args:
        cfg: a config, normally one returned by :func:`load_config`.

    Returns:
        A dict that :func:`load_config` accepts and that loads back to an equal config for the same
        world size.
    """
    return cfg.model_dump(mode="json")
