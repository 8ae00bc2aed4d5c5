"""The top-level config model, :class:`ZeroshardConfig`, in DeepSpeed's JSON schema.

Build instances with :func:`zeroshard.config.load_config`, which also resolves ``"auto"`` values and the
batch-size arithmetic; the model alone validates types and bounds only.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, field_validator

from zeroshard.config.blocks import (
    ActivationCheckpointingConfig,
    AIOConfig,
    CheckpointConfig,
    CometConfig,
    CommsLoggerConfig,
    CSVMonitorConfig,
    FlopsProfilerConfig,
    OptimizerConfig,
    SchedulerConfig,
    TensorBoardConfig,
    TimersConfig,
    WandbConfig,
)
from zeroshard.config.fields import ConfigModel, DTypeName, Float, Int, dtype_of
from zeroshard.config.precision import BF16Config, DataTypesConfig, FP16Config
from zeroshard.config.zero import ZeroConfig

__all__ = ["ZeroshardConfig"]


class ZeroshardConfig(ConfigModel):
    """A complete training config. After :func:`~zeroshard.config.load_config` the three batch fields
    are ints satisfying ``train_batch_size == micro * grad_acc * world_size``."""

    train_batch_size: Int | None = Field(default=None, gt=0)
    """Global batch size per optimizer step: micro batch * accumulation steps * data-parallel ranks."""

    train_micro_batch_size_per_gpu: Int | None = Field(default=None, gt=0)
    """Batch size of one forward/backward on one rank."""

    gradient_accumulation_steps: Int | None = Field(default=None, gt=0)
    """Micro-steps accumulated per optimizer step."""

    gradient_clipping: Float = Field(default=1.0, ge=0)
    """Clip the global gradient norm to this value; 0 disables clipping (DeepSpeed 0.19 default: 1.0)."""

    fp16: FP16Config = Field(default_factory=FP16Config)
    """fp16 mixed precision and loss scaling."""

    bf16: BF16Config = Field(default_factory=BF16Config)
    """bf16 mixed precision (also accepted as ``bfloat16``)."""

    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    """ZeRO stage and partitioning options."""

    optimizer: OptimizerConfig | None = None
    """Optimizer to build when the client passes none."""

    scheduler: SchedulerConfig | None = None
    """Learning-rate scheduler to build when the client passes none."""

    steps_per_print: Int | None = Field(default=None, gt=0)
    """Log progress every this many optimizer steps (None: never; DeepSpeed 0.19 default None)."""

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _infinity_is_never(cls, value: object) -> object:
        # accelerate writes float("inf") to silence DeepSpeed's progress lines (DeepSpeed never prints then)
        return None if isinstance(value, float) and value == float("inf") else value

    wall_clock_breakdown: bool = False
    """Time forward, backward and step and log the breakdown."""

    non_finite_gradients: Literal["skip", "raise"] = "skip"
    """zeroshard only: what a NaN or Inf gradient does without fp16's dynamic loss scaling (bf16,
    fp32, static fp16): ``skip`` the step with a warning naming the step and the first parameter
    with a non-finite gradient, or ``raise`` a ``FloatingPointError`` saying the same."""

    collective_timeout: Float | None = Field(default=None, gt=0)
    """zeroshard only: seconds a collective may wait for the other ranks before the job fails with
    an error naming the operation and the ranks that did not arrive (default: the process group's,
    10 minutes when zeroshard created it)."""

    dump_state: bool = False
    """Print the engine state after initialization."""

    memory_breakdown: bool = False
    """Log accelerator memory usage at points of the training step."""

    prescale_gradients: bool = False
    """Divide gradients by the data-parallel size before (instead of after) reduction."""

    gradient_predivide_factor: Float = Field(default=1.0, gt=0)
    """Divide gradients by this factor before reduction and by world_size/factor after it."""

    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    """How gradients combine across the data-parallel ranks: their ``mean`` (the default), or their
    ``sum`` with no division at all (``prescale_gradients`` and ``gradient_predivide_factor`` then do
    nothing, as in DeepSpeed; for a loss summed, not averaged, over the global batch). Stages 0-2."""

    @field_validator("gradient_allreduce_op", mode="before")
    @classmethod
    def _op_lower_case(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value  # DeepSpeed accepts "SUM", "Mean"

    communication_data_type: DTypeName | None = None
    """Dtype of gradient reduction (fp32, fp16, bf16); None: the gradient accumulation dtype."""

    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    """Explicit data types (gradient accumulation)."""

    dataloader_drop_last: bool = False
    """Drop each rank's last partial micro batch of an epoch in the loader ``initialize`` builds."""

    zero_allow_untested_optimizer: bool = False
    """Allow a client optimizer that ZeRO has not been tested with."""

    zero_force_ds_cpu_optimizer: bool = True
    """With optimizer offload, require the CPU-optimized optimizer implementation."""

    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoint options."""

    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig
    )
    """Activation checkpointing options."""

    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    """TensorBoard monitor."""

    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig)
    """CSV monitor."""

    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases monitor."""

    comet: CometConfig = Field(default_factory=CometConfig)
    """Comet monitor."""

    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    """FLOPs profiler."""

    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    """Communication logger."""

    timers: TimersConfig = Field(default_factory=TimersConfig)
    """DeepSpeed's throughput timer (``engine.tput_timer``; zeroshard's own step log reports throughput)."""

    aio: AIOConfig = Field(default_factory=AIOConfig)
    """Asynchronous I/O settings for NVMe offload."""

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage (0-3)."""
        return self.zero_optimization.stage

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype of the model's compute weights: float16, bfloat16 or float32."""
        if self.fp16.enabled:
            return torch.float16
        if self.bf16.enabled:
            return torch.bfloat16
        return torch.float32

    @property
    def grad_accum_dtype(self) -> torch.dtype:
        """Dtype of gradient accumulation (``data_types.grad_accum_dtype``; float32 when unset)."""
        return dtype_of(self.data_types.grad_accum_dtype, torch.float32)

    @property
    def reduce_dtype(self) -> torch.dtype:
        """Dtype of gradient reduction (``communication_data_type``; the grad accumulation dtype if unset)."""
        return dtype_of(self.communication_data_type, self.grad_accum_dtype)

    @property
    def dynamic_loss_scale(self) -> bool:
        """True when fp16 is enabled with ``loss_scale == 0`` (dynamic loss scaling)."""
        return self.fp16.enabled and self.fp16.loss_scale == 0

    def get(self, key: str, default: Any = None) -> Any:
        """A top-level key in DeepSpeed's JSON form, as on the dict that DeepSpeed's ``engine.config`` is
        (Hugging Face's Trainer reads ``engine.config.get("zero_optimization", {})``)."""
        return self.model_dump(mode="json").get(key, default)
