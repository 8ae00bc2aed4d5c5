"""Where each config key acts: one table of consumers, one of keys accepted without effect.

Every leaf of the schema is in exactly one of three places, and ``tests/unit/test_config_schema_walk.py``
walks the schema to keep it so:

- :data:`CONSUMERS`: the key changes what zeroshard does; the file named reads it (the test checks
  that the file mentions the field);
- :data:`NO_EFFECT`: the key is accepted (so DeepSpeed configs load) but changes nothing here, for the
  reason given. :func:`warn_no_effect` warns once per key, naming it, when a config sets it to
  anything but its default;
- :data:`zeroshard.config.support.NOT_YET_SUPPORTED`: a value that needs a missing feature is an error
  (keys under such a block count too: ``zero_optimization.offload_optimizer.*``).
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel

from zeroshard.config.schema import ZeroshardConfig

__all__ = ["CONSUMERS", "NO_EFFECT", "no_effect_keys_set", "warn_no_effect"]

logger = logging.getLogger("zeroshard")

_Z = "zero_optimization."

# fmt: off
CONSUMERS: dict[str, str] = {
    "train_batch_size": "config/batch.py",
    "train_micro_batch_size_per_gpu": "config/batch.py",
    "gradient_accumulation_steps": "config/batch.py",
    "gradient_clipping": "initialize.py",
    "fp16.enabled": "config/schema.py",
    "fp16.auto_cast": "initialize.py",
    "fp16.loss_scale": "core/precision/policy.py",
    "fp16.initial_scale_power": "core/precision/policy.py",
    "fp16.loss_scale_window": "core/precision/policy.py",
    "fp16.hysteresis": "core/precision/policy.py",
    "fp16.consecutive_hysteresis": "core/precision/policy.py",
    "fp16.min_loss_scale": "core/precision/policy.py",
    "bf16.enabled": "config/schema.py",
    "bf16.auto_cast": "initialize.py",
    _Z + "stage": "config/schema.py",
    _Z + "reduce_bucket_size": "initialize.py",
    _Z + "allgather_bucket_size": "initialize.py",
    _Z + "overlap_comm": "initialize.py",
    _Z + "offload_optimizer.device": "core/offload/policy.py",
    _Z + "offload_optimizer.nvme_path": "core/offload/policy.py",
    _Z + "offload_optimizer.pin_memory": "core/offload/policy.py",
    _Z + "offload_optimizer.buffer_count": "core/offload/policy.py",
    _Z + "offload_optimizer.ratio": "core/offload/policy.py",
    _Z + "offload_param.device": "core/offload/policy.py",
    _Z + "offload_param.nvme_path": "core/offload/policy.py",
    _Z + "offload_param.pin_memory": "core/offload/policy.py",
    _Z + "offload_param.buffer_count": "core/offload/policy.py",
    _Z + "offload_param.buffer_size": "core/offload/policy.py",
    _Z + "sub_group_size": "core/offload/policy.py",
    _Z + "zero_quantized_weights": "initialize.py",
    _Z + "zero_quantized_gradients": "initialize.py",
    _Z + "zero_hpz_partition_size": "initialize.py",
    _Z + "hybrid_shard_size": "initialize.py",
    "aio.block_size": "core/offload/policy.py",
    "aio.queue_depth": "core/offload/policy.py",
    "aio.intra_op_parallelism": "core/offload/policy.py",
    "aio.use_gds": "core/offload/policy.py",
    _Z + "stage3_max_live_parameters": "initialize.py",
    _Z + "stage3_prefetch_bucket_size": "initialize.py",
    _Z + "stage3_param_persistence_threshold": "initialize.py",
    _Z + "stage3_module_granularity_threshold": "initialize.py",
    _Z + "ignore_unused_parameters": "engine.py",
    _Z + "leaf_module.classes": "initialize.py",
    _Z + "leaf_module.names": "initialize.py",
    _Z + "leaf_module.name_suffixes": "initialize.py",
    "optimizer.type": "initialize.py",
    "optimizer.params": "initialize.py",
    "scheduler.type": "initialize.py",
    "scheduler.params": "initialize.py",
    "steps_per_print": "monitor/report.py",
    "dataloader_drop_last": "initialize.py",
    "wall_clock_breakdown": "engine.py",
    "non_finite_gradients": "engine.py",
    "bf16.check_grad_overflow": "initialize.py",
    "collective_timeout": "initialize.py",
    "dump_state": "initialize.py",
    "memory_breakdown": "engine.py",
    "prescale_gradients": "initialize.py",
    "gradient_predivide_factor": "initialize.py",
    "gradient_allreduce_op": "initialize.py",
    "communication_data_type": "config/schema.py",
    "data_types.grad_accum_dtype": "config/schema.py",
    "checkpoint.tag_validation": "checkpoint/tags.py",
    "checkpoint.auto_resume": "initialize.py",
    "activation_checkpointing.partition_activations": "activations/settings.py",
    "activation_checkpointing.cpu_checkpointing": "activations/settings.py",
    "activation_checkpointing.synchronize_checkpoint_boundary": "activations/settings.py",
    "activation_checkpointing.profile": "activations/settings.py",
    "tensorboard.enabled": "monitor/master.py",
    "tensorboard.output_path": "monitor/tensorboard.py",
    "tensorboard.job_name": "monitor/tensorboard.py",
    "csv_monitor.enabled": "monitor/master.py",
    "csv_monitor.output_path": "monitor/csv_monitor.py",
    "csv_monitor.job_name": "monitor/csv_monitor.py",
    "wandb.enabled": "monitor/master.py",
    "wandb.group": "monitor/wandb.py",
    "wandb.team": "monitor/wandb.py",
    "wandb.project": "monitor/wandb.py",
    "comet.enabled": "monitor/master.py",
    "comet.samples_log_interval": "monitor/comet.py",
    "comet.project": "monitor/comet.py",
    "comet.workspace": "monitor/comet.py",
    "comet.api_key": "monitor/comet.py",
    "comet.experiment_name": "monitor/comet.py",
    "comet.experiment_key": "monitor/comet.py",
    "comet.online": "monitor/comet.py",
    "comet.mode": "monitor/comet.py",
    "flops_profiler.enabled": "engine.py",
    "flops_profiler.recompute_fwd_factor": "profiling/flops.py",
    "flops_profiler.profile_step": "profiling/flops.py",
    "flops_profiler.module_depth": "profiling/text.py",
    "flops_profiler.top_modules": "profiling/text.py",
    "flops_profiler.detailed": "profiling/text.py",
    "flops_profiler.output_file": "profiling/text.py",
    "flops_profiler.peak_tflops": "profiling/peaks.py",
    "comms_logger.enabled": "engine.py",
    # accelerate (so transformers' Trainer.save_model) reads it through the engine: false saves a full
    # checkpoint instead of the 16-bit weights; zeroshard's own save_16bit_model works either way
    _Z + "stage3_gather_16bit_weights_on_model_save": "deepspeed/engine_api/config_accessors.py",
    "timers.throughput.enabled": "deepspeed/timers.py",
    "timers.throughput.synchronized": "deepspeed/timers.py",
    "comms_logger.verbose": "monitor/comms.py",
    "comms_logger.prof_all": "monitor/comms.py",
    "comms_logger.debug": "monitor/comms.py",
    "comms_logger.prof_ops": "monitor/comms.py",
}
"""Key path -> the module (under ``src/zeroshard``) that reads it."""

NO_EFFECT: dict[str, str] = {
    _Z + "pipeline_loading_checkpoint": ("each rank reads only the ranges it owns and nothing is gathered, so "
                                         "loading holds one shard in host memory without the ranks taking turns"),
    _Z + "contiguous_gradients": "gradients always go to flat contiguous buckets",
    _Z + "reduce_scatter": "gradients are always reduce-scattered at stages 1-3 (all-reduced at stage 0)",
    _Z + "allgather_partitions": "updated shards are always all-gathered, never broadcast one by one",
    _Z + "round_robin_gradients": ("with optimizer offload each rank moves only its own reduced gradient shard "
                                   "to the host; there is nothing to spread over ranks"),
    _Z + "stage3_max_reuse_distance": ("subsumed by stage3_max_live_parameters, an LRU budget "
                                       "(docs/deepspeed-differences.md)"),
    _Z + "stage3_model_persistence_threshold": ("only stage3_param_persistence_threshold decides which units "
                                                "stay gathered; their total is not capped"),
    _Z + "elastic_checkpoint": "every checkpoint reloads at any world size and stage",
    _Z + "offload_optimizer.fast_init": ("the optimizer creates its state in its first step, sub-group by "
                                         "sub-group, straight into the swap buffers: there is no slow path"),
    _Z + "offload_param.max_in_cpu": ("with NVMe parameter offload every parameter shard lives in the swap file; "
                                      "host memory holds only the read buffers (buffer_count x buffer_size)"),
    "activation_checkpointing.contiguous_memory_optimization": ("torch's caching allocator reuses the freed "
                                                                "blocks on an accelerator; on CPU see the "
                                                                "allocator setting in docs/memory.md"),
    "activation_checkpointing.number_checkpoints": "only sizes DeepSpeed's contiguous buffer (see the key above)",
    "zero_allow_untested_optimizer": ("any elementwise torch optimizer steps on the shard; the ones known to read "
                                      "a parameter's shape are refused whatever its value"),
    "zero_force_ds_cpu_optimizer": ("any torch optimizer steps on host tensors with optimizer offload (Adam and "
                                    "AdamW use torch's fused CPU kernel); none is refused"),
    "checkpoint.load_universal": ("zeroshard checkpoints reload at any world size and stage without conversion; "
                                  "DeepSpeed universal-checkpoint directories are not read"),
    "checkpoint.use_node_local_storage": "every rank writes its shard to save_dir (a file system all nodes share)",
    **{f"aio.{k}": "swap files are read and written by a thread pool over preadv/pwritev, not libaio submissions"
       for k in ("single_submit", "overlap_events")},
}
"""Key path -> why the key is accepted but has no effect."""
# fmt: on


def _lookup(node: Any, path: str) -> tuple[Any, Any]:
    """``(value, default)`` of the field at dotted ``path`` of ``node``."""
    *parents, leaf = path.split(".")
    for part in parents:
        node = getattr(node, part)
    assert isinstance(node, BaseModel)
    field = type(node).model_fields[leaf]
    default = field.get_default(call_default_factory=True)
    return getattr(node, leaf), default


def no_effect_keys_set(cfg: ZeroshardConfig) -> dict[str, Any]:
    """The keys of :data:`NO_EFFECT` whose value in ``cfg`` differs from the default, with the value."""
    out: dict[str, Any] = {}
    for path in NO_EFFECT:
        value, default = _lookup(cfg, path)
        if value != default:
            out[path] = value
    return out


_warned: set[str] = set()  # once per key and process: a loop over configs must not flood the log


def warn_no_effect(cfg: ZeroshardConfig) -> list[str]:
    """Warn once per key (per process) about each key set to a non-default value that has no effect.

    Returns:
        The keys warned about now.
    """
    warned = []
    for path, value in no_effect_keys_set(cfg).items():
        if path in _warned:
            continue
        _warned.add(path)
        warned.append(path)
        logger.warning("zeroshard: config key '%s' = %r has no effect in zeroshard: %s", path, value, NO_EFFECT[path])
    return warned
