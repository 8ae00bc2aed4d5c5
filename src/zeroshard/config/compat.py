"""DeepSpeed compatibility: key aliases, and the DeepSpeed features that zeroshard does not have.

A DeepSpeed key in :data:`DEEPSPEED_ONLY` is an error (``'<key>' is a DeepSpeed feature that zeroshard
does not support``) unless its value is DeepSpeed's "off" value, in which case it changes nothing and
is dropped (logged at debug level). It is never silently ignored while active.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from zeroshard.config.validation import schema_kind
from zeroshard.errors import ConfigError

__all__ = [
    "ALIASES",
    "ANY_VALUE",
    "DEEPSPEED_ONLY",
    "DEPRECATED_OFFLOAD",
    "DISABLED",
    "NEVER",
    "convert_deprecated_offload",
    "drop_dotted_keys",
    "normalize_aliases",
    "normalize_path",
    "reject_deepspeed_only",
]

logger = logging.getLogger("zeroshard")

_Z = "zero_optimization."

ALIASES: dict[str, str] = {
    "bfloat16": "bf16",
    _Z + "gather_16bit_weights_on_model_save": _Z + "stage3_gather_16bit_weights_on_model_save",
    _Z + "stage3_gather_fp16_weights_on_model_save": _Z + "stage3_gather_16bit_weights_on_model_save",
    _Z + "max_live_parameters": _Z + "stage3_max_live_parameters",
    _Z + "max_reuse_distance": _Z + "stage3_max_reuse_distance",
    _Z + "prefetch_bucket_size": _Z + "stage3_prefetch_bucket_size",
    _Z + "param_persistence_threshold": _Z + "stage3_param_persistence_threshold",
    _Z + "model_persistence_threshold": _Z + "stage3_model_persistence_threshold",
    "aio.thread_count": "aio.intra_op_parallelism",
}
"""Alternative key paths DeepSpeed accepts, mapped to the canonical key path used by zeroshard."""


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


NEVER = _Marker("NEVER")
"""The key is an error whatever its value."""
DISABLED = _Marker("DISABLED")
"""The key is accepted only as an empty/None block or a block with ``"enabled": false``."""
ANY_VALUE = _Marker("ANY_VALUE")
"""The key has no effect without another unsupported key; any value is accepted and dropped."""


class AtMost:
    """The key is off at any number up to ``limit`` (DeepSpeed enables the feature above it)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __repr__(self) -> str:
        return f"AtMost({self.limit})"

DEEPSPEED_ONLY: dict[str, Any] = {
    # top-level features
    "pipeline": NEVER,
    "moe": NEVER,
    "compression_training": NEVER,
    "sparse_attention": NEVER,
    "quantize_training": NEVER,
    "amp": DISABLED,
    "elasticity": DISABLED,
    "nebula": DISABLED,
    "eigenvalue": DISABLED,
    "progressive_layer_drop": DISABLED,
    "curriculum_learning": DISABLED,
    "data_efficiency": DISABLED,
    "autotuning": DISABLED,
    "hybrid_engine": DISABLED,
    "torch_autocast": DISABLED,
    "datastates_ckpt": DISABLED,
    "compile": DISABLED,
    "tensor_parallel": DISABLED,
    "expert_parallel": DISABLED,
    "weight_quantization": NEVER,
    "sparse_gradients": False,
    "graph_harvesting": False,
    "disable_allgather": False,
    "seq_parallel_communication_data_type": None,
    "sequence_parallel_size": 1,
    "use_data_before_expert_parallelism": False,
    "managed_gradient_accumulation": True,
    "disable_python_gc": False,
    "log_level": None,
    "vocabulary_size": ANY_VALUE,
    # zero_optimization
    _Z + "zero_quantized_nontrainable_weights": False,
    _Z + "mics_shard_size": AtMost(0),  # older DeepSpeed: MiCS when > 0 (0.19.8 refuses the key)
    _Z + "mics_hierarchical_params_gather": False,
    _Z + "zeropp_loco_param": None,
    _Z + "zenflow": None,
    _Z + "use_multi_rank_bucket_allreduce": True,
    _Z + "compute_grad_norm": True,
    _Z + "load_from_fp32_weights": True,
    _Z + "legacy_stage1": False,
    _Z + "parameter_alignment": False,
    # DeepSpeed's true patches F.linear at ZeRO-3 so that backward re-gathers the weight instead of
    # saving it; zeroshard re-gathers it for every layer without patching anything, and false (leave
    # F.linear alone) is what it does too (DeepSpeed-Chat's configs all say false): either value.
    _Z + "memory_efficient_linear": ANY_VALUE,
    _Z + "override_module_apply": True,
    _Z + "log_trace_cache_warnings": False,
    _Z + "enable_sanity_checks": False,
    _Z + "save_muon_momentum_buffer_in_memory": False,
    _Z + "stage3_use_all_reduce_for_fetch_params": False,
    _Z + "stage3_allgather_sequential": False,
    # NVMe swapping is always pipelined (read ahead, write behind): either value describes it.
    _Z + "offload_optimizer.pipeline_read": ANY_VALUE,
    _Z + "offload_optimizer.pipeline_write": ANY_VALUE,
    _Z + "offload_optimizer.super_offload": False,
    _Z + "offload_optimizer.cpuadam_cores_perc": ANY_VALUE,
    # precision
    "fp16.fp16_master_weights_and_grads": False,
    # true: each micro-step's gradients go into fp32 accumulators at once, which is what zeroshard
    # does (data_types.grad_accum_dtype, fp32 by default); false asks for nothing beyond that here.
    "bf16.immediate_grad_update": ANY_VALUE,
    "bf16.bf16_master_weights_and_grads": False,
    "bf16.bf16_optimizer_states": False,
    "data_types.param_dtype": None,
    "data_types.buffer_dtype": None,
    "data_types.keep_in_fp32_modules": "auto",
    # checkpoint / optimizer
    "checkpoint.parallel_write": DISABLED,
    "checkpoint.checkpoint_serialization": True,
    "checkpoint.writer": None,
    "optimizer.legacy_fusion": False,
}
"""DeepSpeed key paths zeroshard does not implement, mapped to the value under which they are harmless."""


_BOOL: TypeAdapter[bool] = TypeAdapter(bool)


def _as_bool(value: Any) -> bool | None:
    """``value`` read as a bool the way DeepSpeed's (and zeroshard's) pydantic fields read one: 0/1 and
    "false"/"true"/"off"/"on"... count; None when it is not a bool at all."""
    try:
        return bool(_BOOL.validate_python(value))
    except ValidationError:
        return None


def _is_off(value: Any, off: Any) -> bool:
    if off is ANY_VALUE:
        return True
    if off is NEVER:
        return False
    if off is DISABLED:
        return value is None or value == {} or (isinstance(value, dict) and _as_bool(value.get("enabled")) is False)
    if isinstance(off, AtMost):
        return isinstance(value, (int, float)) and value <= off.limit
    if off is None:
        return value is None or _as_bool(value) is False
    if isinstance(off, bool):
        return value is not None and _as_bool(value) is off
    return bool(value == off)


def _hint(off: Any) -> str:
    if off is NEVER or off is ANY_VALUE:
        return "remove it"
    if off is DISABLED:
        return 'remove it or set "enabled": false'
    if isinstance(off, AtMost):
        return f"remove it or set it to at most {off.limit}"
    return f"remove it or set it to {json.dumps(off)}"


def _parent(raw: dict[str, Any], parts: list[str]) -> dict[str, Any] | None:
    node: Any = raw
    for part in parts:
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


DEPRECATED_OFFLOAD: dict[str, str] = {
    _Z + "cpu_offload": _Z + "offload_optimizer",
    _Z + "cpu_offload_param": _Z + "offload_param",
    _Z + "cpu_offload_use_pin_memory": _Z + "offload_optimizer.pin_memory",
}
"""DeepSpeed's deprecated offload switches, which it still reads as the blocks that replaced them."""


def convert_deprecated_offload(raw: dict[str, Any]) -> None:
    """Turn ``cpu_offload: true`` / ``cpu_offload_param: true`` into the ``offload_optimizer`` /
    ``offload_param`` blocks with ``device: cpu``, as DeepSpeed does (in place), with
    ``cpu_offload_use_pin_memory`` as their ``pin_memory``; false or null drop out.

    Raises:
        ConfigError: a value that is not a bool, or a switch beside the block that replaced it.
    """
    zero = raw.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    switches = {}
    for path in DEPRECATED_OFFLOAD:
        key = path.rsplit(".", 1)[-1]
        if key in zero:
            value = zero.pop(key)
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"must be true or false, got {value!r}", key=path)
            switches[key] = value
    pin = switches.pop("cpu_offload_use_pin_memory", None)
    for key, on in switches.items():
        block = DEPRECATED_OFFLOAD[_Z + key].rsplit(".", 1)[-1]
        if not on:
            continue
        if zero.get(block) is not None:
            raise ConfigError(f"'{_Z}{key}' is DeepSpeed's deprecated spelling of '{_Z}{block}'; give only one",
                              key=_Z + block)
        zero[block] = {"device": "cpu", **({"pin_memory": pin} if pin is not None else {})}
        logger.warning("zeroshard: config: '%s%s: true' is deprecated (in DeepSpeed too); read as '%s%s': %s",
                       _Z, key, _Z, block, json.dumps(zero[block]))


def drop_dotted_keys(raw: dict[str, Any], root: type[BaseModel]) -> None:
    """Drop top-level keys that spell a nested key as a dotted path (``"zero_optimization.reduce_bucket_size"``),
    with a warning naming them (in place).

    DeepSpeed reads nested blocks only and ignores such keys, so a config carrying them trains there as
    if they were absent; TRL's ``prepare_deepspeed`` adds three of them to the ZeRO-3 config of every
    reference or teacher model it builds (DPO, KTO, GRPO). zeroshard trains as DeepSpeed does and says
    so. A dotted key that is not a config path stays, and is the unknown-key error.
    """
    dotted = [k for k in raw if isinstance(k, str) and "." in k
              and (schema_kind(root, normalize_path(k)) is not None or normalize_path(k) in DEEPSPEED_ONLY)]
    for key in dotted:
        del raw[key]
    if dotted:
        logger.warning("zeroshard: config: ignoring %s, as DeepSpeed does: a key is read from its block "
                       "(write it nested to apply it)", ", ".join(f"'{k}'" for k in dotted))


def normalize_aliases(raw: dict[str, Any]) -> None:
    """Rename alias keys of ``raw`` (in place) to their canonical names.

    Raises:
        ConfigError: an alias and its canonical key are both given.
    """
    for alias, canonical in ALIASES.items():
        parts = alias.split(".")
        parent = _parent(raw, parts[:-1])
        if parent is None or parts[-1] not in parent:
            continue
        new_name = canonical.rsplit(".", 1)[-1]
        if new_name in parent:
            raise ConfigError(
                f"'{alias}' and '{canonical}' are the same setting; give only one", key=canonical
            )
        parent[new_name] = parent.pop(parts[-1])


def normalize_path(path: str) -> str:
    """Return the canonical form of a dotted key path (aliases replaced)."""
    for alias, canonical in ALIASES.items():
        if path == alias or path.startswith(alias + "."):
            return canonical + path[len(alias) :]
    return path


def reject_deepspeed_only(raw: dict[str, Any]) -> None:
    """Raise for any active DeepSpeed-only feature in ``raw``; drop inactive ones (in place).

    Raises:
        ConfigError: naming the first DeepSpeed-only key whose value enables a feature zeroshard lacks.
    """
    for path, off in DEEPSPEED_ONLY.items():
        parts = path.split(".")
        parent = _parent(raw, parts[:-1])
        if parent is None or parts[-1] not in parent:
            continue
        value = parent[parts[-1]]
        if not _is_off(value, off):
            raise ConfigError(
                f"'{path}' is a DeepSpeed feature that zeroshard does not support ({_hint(off)})", key=path
            )
        logger.debug("config: dropping inactive DeepSpeed-only key %r = %r", path, value)
        del parent[parts[-1]]
