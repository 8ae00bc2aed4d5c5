"""DeepSpeed's config accessors on the engine: ``engine.fp16_enabled()``, ``engine.zero_optimization()``, ...

Each returns what ``DeepSpeedEngine``'s method of the same name returns for the same JSON config
(DeepSpeed 0.19.8, ``deepspeed/runtime/engine.py``). Keys that zeroshard accepts only at their "off"
value (:data:`zeroshard.config.compat.DEEPSPEED_ONLY`) return that value: a config that loaded has it.
The few accessors that report zeroshard's effective behaviour instead say so in their docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zeroshard.config.schema import ZeroshardConfig
from zeroshard.errors import NotYetSupportedError


class ConfigAccessors:
    """Read-only views of the engine's config, under DeepSpeed's method names."""

    config: ZeroshardConfig
    #: the engine's own (:class:`zeroshard.engine.Engine`)
    train_batch_size: Callable[[], int]
    train_micro_batch_size_per_gpu: Callable[[], int]
    gradient_accumulation_steps: Callable[[], int]
    zero_optimization_stage: Callable[[], int]

    # -- batch sizes ---------------------------------------------------------------------------
    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)`` as ints
        (DeepSpeed's docstring promises ints; its code returns the bound methods)."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def steps_per_print(self) -> int | None:
        """``steps_per_print`` (None: never)."""
        return self.config.steps_per_print

    def dataloader_drop_last(self) -> bool:
        """``dataloader_drop_last``: whether the loaders drop each rank's last partial micro batch."""
        return bool(self.config.dataloader_drop_last)

    # -- precision --------------------------------------------------------------------------
    def fp16_enabled(self) -> bool:
        """``fp16.enabled``."""
        return bool(self.config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        """``bf16.enabled``."""
        return bool(self.config.bf16.enabled)

    def bf16_enabled(self) -> bool:
        """``bf16.enabled`` (DeepSpeed's engine spells it ``bfloat16_enabled``)."""
        return self.bfloat16_enabled()

    def fp16_auto_cast(self) -> bool:
        """``fp16.auto_cast`` (zeroshard's default is True, DeepSpeed's False)."""
        return bool(self.config.fp16.auto_cast)

    def loss_scale(self) -> float:
        """``fp16.loss_scale`` of the config, as in DeepSpeed: 0 means dynamic loss scaling. The
        scale in use now is :attr:`cur_scale`."""
        return float(self.config.fp16.loss_scale)

    def dynamic_loss_scale(self) -> bool:
        """Whether ``fp16.loss_scale`` is 0 (DeepSpeed does not look at ``fp16.enabled`` here)."""
        return self.config.fp16.loss_scale == 0

    def initial_dynamic_scale(self) -> int:
        """``2 ** fp16.initial_scale_power``."""
        return int(2 ** self.config.fp16.initial_scale_power)

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """DeepSpeed's dictionary of dynamic loss-scaling arguments."""
        fp16 = self.config.fp16
        return {"init_scale": 2 ** fp16.initial_scale_power, "scale_window": fp16.loss_scale_window,
                "delayed_shift": fp16.hysteresis, "consecutive_hysteresis": fp16.consecutive_hysteresis,
                "min_scale": fp16.min_loss_scale}

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """``(model dtype, gradient accumulation dtype)``; the latter is fp32 unless
        ``data_types.grad_accum_dtype`` says otherwise (DeepSpeed: the model dtype)."""
        return self.config.compute_dtype, self.config.grad_accum_dtype

    def fp16_master_weights_and_gradients(self) -> bool:
        """Always False: master weights are fp32."""
        return False

    def bf16_master_weights_and_gradients(self) -> bool:
        """Always False: master weights are fp32."""
        return False

    def bf16_optimizer_states(self) -> bool:
        """Always False: optimizer states are fp32."""
        return False

    def torch_autocast_enabled(self) -> bool:
        """Always False (``torch_autocast`` is refused unless disabled)."""
        return False

    def torch_autocast_dtype(self) -> torch.dtype | None:
        """None: no torch autocast."""
        return None

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: ``communication_data_type``, else the gradient
        accumulation dtype (fp32 unless set; DeepSpeed: the model dtype)."""
        return self.config.reduce_dtype

    @communication_data_type.setter
    def communication_data_type(self, value: Any) -> None:
        raise NotYetSupportedError("setting engine.communication_data_type after initialize() is not supported: "
                                   "set communication_data_type in the config", key="communication_data_type")

    def postscale_gradients(self) -> bool:
        """Not ``prescale_gradients``."""
        return not self.config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        """``gradient_predivide_factor``."""
        return float(self.config.gradient_predivide_factor)

    def gradient_clipping(self) -> float:
        """``gradient_clipping`` (0: no clipping)."""
        return float(self.config.gradient_clipping)

    # -- ZeRO ----------------------------------------------------------------------------------
    def zero_optimization(self) -> bool:
        """Whether ZeRO is on (stage > 0)."""
        return self.config.zero_stage > 0

    def zero_optimization_partition_gradients(self) -> bool:
        """Stage 2 or 3."""
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        """Stage 3."""
        return self.zero_optimization_stage() >= 3

    def is_first_weights_partition_group(self) -> bool:
        """As DeepSpeed: whether weights are partitioned."""
        return self.zero_optimization_partition_weights()

    def zero_allow_untested_optimizer(self) -> bool:
        """``zero_allow_untested_optimizer`` (no effect: any elementwise torch optimizer works)."""
        return bool(self.config.zero_allow_untested_optimizer)

    def zero_force_ds_cpu_optimizer(self) -> bool:
        """``zero_force_ds_cpu_optimizer`` (no effect without offload)."""
        return bool(self.config.zero_force_ds_cpu_optimizer)

    def zero_reduce_scatter(self) -> bool:
        """``zero_optimization.reduce_scatter``."""
        return bool(self.config.zero_optimization.reduce_scatter)

    def zero_overlap_comm(self) -> bool:
        """``zero_optimization.overlap_comm`` (resolved: True at stage 3 when unset)."""
        return bool(self.config.zero_optimization.overlap_comm)

    def zero_offload_optimizer(self) -> Any:
        """The ``offload_optimizer`` block, or None when not offloading (as DeepSpeed)."""
        block = self.config.zero_optimization.offload_optimizer
        return None if block.device == "none" else block

    def zero_offload_param(self) -> Any:
        """The ``offload_param`` block, or None when not offloading (as DeepSpeed)."""
        block = self.config.zero_optimization.offload_param
        return None if block.device == "none" else block

    def zero_use_cpu_optimizer(self) -> bool:
        """Whether the optimizer is offloaded (to CPU or NVMe)."""
        return self.config.zero_optimization.offload_optimizer.device in ("cpu", "nvme")

    def zero_cpu_offload(self) -> bool:
        """Whether the optimizer is offloaded to the CPU."""
        return self.config.zero_optimization.offload_optimizer.device == "cpu"

    def zero_partial_offload(self) -> float:
        """``offload_optimizer.ratio``."""
        return float(self.config.zero_optimization.offload_optimizer.ratio)

    def zero_nvme_offload_optimizer(self) -> bool:
        """Always False: no NVMe offload."""
        return False

    def zero_sub_group_size(self) -> int:
        """``zero_optimization.sub_group_size``."""
        return int(self.config.zero_optimization.sub_group_size)

    def zero_reduce_bucket_size(self) -> int:
        """``zero_optimization.reduce_bucket_size`` as configured (buckets may be smaller when unset;
        see ``initialize``)."""
        return int(self.config.zero_optimization.reduce_bucket_size)

    def zero_allgather_bucket_size(self) -> int:
        """``zero_optimization.allgather_bucket_size`` as configured."""
        return int(self.config.zero_optimization.allgather_bucket_size)

    def zero_contiguous_gradients(self) -> bool:
        """``zero_optimization.contiguous_gradients``."""
        return bool(self.config.zero_optimization.contiguous_gradients)

    def zero_allgather_partitions(self) -> bool:
        """``zero_optimization.allgather_partitions``."""
        return bool(self.config.zero_optimization.allgather_partitions)

    def zero_round_robin_gradients(self) -> bool:
        """``zero_optimization.round_robin_gradients``."""
        return bool(self.config.zero_optimization.round_robin_gradients)

    def zero_elastic_checkpoint(self) -> bool:
        """``zero_optimization.elastic_checkpoint``."""
        return bool(self.config.zero_optimization.elastic_checkpoint)

    def zero_max_live_parameters(self) -> int:
        """``zero_optimization.stage3_max_live_parameters``."""
        return int(self.config.zero_optimization.stage3_max_live_parameters)

    def zero_max_reuse_distance(self) -> int:
        """``zero_optimization.stage3_max_reuse_distance``."""
        return int(self.config.zero_optimization.stage3_max_reuse_distance)

    def zero_prefetch_bucket_size(self) -> int:
        """``zero_optimization.stage3_prefetch_bucket_size``."""
        return int(self.config.zero_optimization.stage3_prefetch_bucket_size)

    def zero_param_persistence_threshold(self) -> int:
        """``zero_optimization.stage3_param_persistence_threshold``."""
        return int(self.config.zero_optimization.stage3_param_persistence_threshold)

    def zero_model_persistence_threshold(self) -> int:
        """``zero_optimization.stage3_model_persistence_threshold``."""
        return int(self.config.zero_optimization.stage3_model_persistence_threshold)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """``zero_optimization.stage3_gather_16bit_weights_on_model_save``."""
        return bool(self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def zero_ignore_unused_parameters(self) -> bool:
        """``zero_optimization.ignore_unused_parameters``."""
        return bool(self.config.zero_optimization.ignore_unused_parameters)

    # Keys accepted only at DeepSpeed's default value (config/compat.py): that value.
    def zero_multi_rank_bucket_allreduce(self) -> bool:
        """Always True (DeepSpeed's default)."""
        return True

    def zero_compute_grad_norm(self) -> bool:
        """Always True: the global norm is computed every step."""
        return True

    def zero_load_from_fp32_weights(self) -> bool:
        """Always True: checkpoints restore the fp32 masters."""
        return True

    def zero_module_granularity_threshold(self) -> int:
        """Always 0 (DeepSpeed's default)."""
        return 0

    def zero_legacy_stage1(self) -> bool:
        """Always False."""
        return False

    def zero_save_muon_momentum_buffer_in_memory(self) -> bool:
        """Always False."""
        return False

    def zero_parameter_alignment(self) -> bool:
        """Always False."""
        return False

    def zero_hpz_partition_size(self) -> int:
        """``zero_optimization.zero_hpz_partition_size`` (ZeRO++ hpZ; 1: off)."""
        return max(1, int(self.config.zero_optimization.zero_hpz_partition_size))

    def zero_quantized_weights(self) -> bool:
        """``zero_optimization.zero_quantized_weights`` (ZeRO++ qwZ)."""
        return bool(self.config.zero_optimization.zero_quantized_weights)

    def zero_quantized_nontrainable_weights(self) -> bool:
        """Always False."""
        return False

    def zero_quantized_gradients(self) -> bool:
        """``zero_optimization.zero_quantized_gradients`` (ZeRO++ qgZ)."""
        return bool(self.config.zero_optimization.zero_quantized_gradients)

    def zero_log_trace_cache_warnings(self) -> bool:
        """Always False."""
        return False

    def zero_allgather_sequential(self) -> bool:
        """Always False."""
        return False

    def is_sanity_checks_enabled(self) -> bool:
        """Always False."""
        return False

    def super_offload(self) -> bool:
        """Always False."""
        return False

    def cpuadam_cores_perc(self) -> float:
        """0.9, DeepSpeed's value without an offload block that sets it."""
        return 0.9

    def zenflow_config(self) -> None:
        """None: no ZenFlow."""
        return None

    def compile_zero_optimization_stage(self) -> bool:
        """Always False: no DeepCompile passes."""
        return False

    def compile_autosp(self) -> bool:
        """Always False."""
        return False

    def compile_autotp(self) -> bool:
        """Always False."""
        return False

    def uses_parallelization_pass_only(self) -> bool:
        """Always False."""
        return False

    def is_deepcompile_enabled(self) -> bool:
        """Always False."""
        return False

    def is_deepcompile_active(self) -> bool:
        """Always False."""
        return False

    def managed_gradient_accumulation(self) -> bool:
        """Always True: the engine counts micro-steps."""
        return True

    def optimizer_legacy_fusion(self) -> bool:
        """Always False."""
        return False

    def checkpoint_serialization_enabled(self) -> bool:
        """Always True (DeepSpeed's default)."""
        return True

    def checkpoint_writer_enabled(self) -> bool:
        """Always False: no decoupled checkpoint writer."""
        return False

    def data_efficiency_enabled(self) -> bool:
        """Always False."""
        return False

    def data_sampling_enabled(self) -> bool:
        """Always False."""
        return False

    def curriculum_learning_enabled(self) -> bool:
        """Always False."""
        return False

    def random_ltd_enabled(self) -> bool:
        """Always False."""
        return False

    def autotuning_enabled(self) -> bool:
        """Always False."""
        return False

    def autotuning_profile_model_info(self) -> bool:
        """Always False."""
        return False

    def log_level(self) -> None:
        """None (DeepSpeed's default; other values are refused at load)."""
        return None

    # -- checkpoints, monitoring ------------------------------------------------------------------
    def checkpoint_tag_validation_enabled(self) -> bool:
        """``checkpoint.tag_validation`` is not IGNORE."""
        return self.config.checkpoint.tag_validation != "IGNORE"

    def checkpoint_tag_validation_fail(self) -> bool:
        """``checkpoint.tag_validation`` is FAIL."""
        return self.config.checkpoint.tag_validation == "FAIL"

    def use_node_local_storage(self) -> bool:
        """``checkpoint.use_node_local_storage``."""
        return bool(self.config.checkpoint.use_node_local_storage)

    def load_universal_checkpoint(self) -> bool:
        """``checkpoint.load_universal``."""
        return bool(self.config.checkpoint.load_universal)

    def wall_clock_breakdown(self) -> bool:
        """``wall_clock_breakdown``."""
        return bool(self.config.wall_clock_breakdown)

    def memory_breakdown(self) -> bool:
        """The ``memory_breakdown`` config flag, as DeepSpeed (bytes per rank: ``memory_usage()``)."""
        return bool(self.config.memory_breakdown)

    def dump_state(self) -> bool:
        """``dump_state``."""
        return bool(self.config.dump_state)

    def flops_profiler_enabled(self) -> bool:
        """``flops_profiler.enabled``."""
        return bool(self.config.flops_profiler.enabled)

    def flops_profiler_recompute_fwd_factor(self) -> float:
        """``flops_profiler.recompute_fwd_factor``."""
        return float(self.config.flops_profiler.recompute_fwd_factor)

    def flops_profiler_profile_step(self) -> int:
        """``flops_profiler.profile_step``."""
        return int(self.config.flops_profiler.profile_step)

    def flops_profiler_module_depth(self) -> int:
        """``flops_profiler.module_depth``."""
        return int(self.config.flops_profiler.module_depth)

    def flops_profiler_top_modules(self) -> int:
        """``flops_profiler.top_modules``."""
        return int(self.config.flops_profiler.top_modules)

    def flops_profiler_detailed(self) -> bool:
        """``flops_profiler.detailed``."""
        return bool(self.config.flops_profiler.detailed)

    def flops_profiler_output_file(self) -> str | None:
        """``flops_profiler.output_file``."""
        return self.config.flops_profiler.output_file

    def aio_config(self) -> dict[str, Any]:
        """The ``aio`` block as a dict (no effect without NVMe offload)."""
        return self.config.aio.model_dump()

    # -- optimizer and scheduler --------------------------------------------------------------------
    def optimizer_params(self) -> dict[str, Any] | None:
        """The config's ``optimizer.params`` (None without an optimizer block)."""
        return dict(self.config.optimizer.params) if self.config.optimizer is not None else None

    def scheduler_name(self) -> str | None:
        """The config's ``scheduler.type`` (None without a scheduler block)."""
        return self.config.scheduler.type if self.config.scheduler is not None else None

    def scheduler_params(self) -> dict[str, Any] | None:
        """The config's ``scheduler.params`` (None without a scheduler block)."""
        return dict(self.config.scheduler.params) if self.config.scheduler is not None else None

    @staticmethod
    def is_map_style_dataset(obj: Any) -> bool:
        """Whether ``obj`` has ``__getitem__`` and ``__len__``."""
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: Any) -> bool:
        """Whether ``obj`` is a torch ``IterableDataset``."""
        return isinstance(obj, torch.utils.data.IterableDataset)
