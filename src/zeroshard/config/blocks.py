"""Smaller config blocks: optimizer, scheduler, checkpoint, activation checkpointing, monitors, profilers
and NVMe asynchronous I/O (``aio``).

Key names and defaults follow DeepSpeed 0.19.x (``deepspeed/runtime/constants.py``,
``deepspeed/monitor/config.py``, ``deepspeed/profiling/constants.py``, ``deepspeed/comm/constants.py``,
``deepspeed/runtime/activation_checkpointing/config.py``, ``deepspeed/runtime/swap_tensor/constants.py``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from zeroshard.config.fields import ConfigModel, Float, Int, upper_if_str

__all__ = [
    "AIOConfig",
    "ActivationCheckpointingConfig",
    "CSVMonitorConfig",
    "CheckpointConfig",
    "CometConfig",
    "CommsLoggerConfig",
    "FlopsProfilerConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "TensorBoardConfig",
    "WandbConfig",
]


class OptimizerConfig(ConfigModel):
    """Optimizer built from the config (when the client passes none)."""

    type: str
    """Optimizer name, matched case-insensitively (``Adam``, ``AdamW``, ``Lamb``...)."""

    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the optimizer; validated by the optimizer factory, not here."""

    @property
    def name(self) -> str:
        """The optimizer type in lower case, for case-insensitive matching."""
        return self.type.lower()


class SchedulerConfig(ConfigModel):
    """Learning-rate scheduler built from the config (when the client passes none)."""

    type: str
    """Scheduler name (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle``...)."""

    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the scheduler; validated by the scheduler factory, not here."""

    @property
    def name(self) -> str:
        """The scheduler type in lower case, for case-insensitive matching."""
        return self.type.lower()


class CheckpointConfig(ConfigModel):
    """Checkpoint saving/loading options."""

    tag_validation: Annotated[Literal["WARN", "IGNORE", "FAIL"], BeforeValidator(upper_if_str)] = "WARN"
    """What to do when ranks save under different tags: Warn, Ignore or Fail (case-insensitive)."""

    load_universal: bool = False
    """Load a universal (world-size independent) checkpoint."""

    use_node_local_storage: bool = False
    """Each node writes its checkpoint shards to node-local storage."""

    auto_resume: str | None = None
    """zeroshard only: a checkpoint directory. ``initialize`` loads the checkpoint its ``latest``
    names when there is one (never one whose save was interrupted), so a job restarted after a
    failure (``zeroshard launch --max_restarts N``) resumes by itself; the training loop continues
    from ``engine.global_steps``."""


class ActivationCheckpointingConfig(ConfigModel):
    """Activation checkpointing options, applied by ``initialize`` to :mod:`zeroshard.deepspeed.checkpointing`
    (unless the script called ``zeroshard.deepspeed.checkpointing.configure`` itself, which wins)."""

    partition_activations: bool = False
    """Keep 1/N of each checkpointed input on each of the N ranks of the model-parallel group (the
    ``mpu`` given to ``checkpointing.configure``) and all-gather it at recomputation; without such
    a group it has no effect (data-parallel ranks hold different activations)."""

    cpu_checkpointing: bool = False
    """Keep checkpointed inputs (or their partitions) in host memory until recomputation."""

    contiguous_memory_optimization: bool = False
    """Accepted without effect: on an accelerator torch's caching allocator reuses freed blocks, so
    there is no fragmentation for DeepSpeed's contiguous buffer to avoid. On CPU, copying the held
    inputs into buffers of their own did not lower a rank's peak RSS (measured); fixing glibc's
    mmap threshold did (docs/memory.md)."""

    number_checkpoints: Int | None = Field(default=None, gt=0)
    """Accepted without effect: it only sizes DeepSpeed's contiguous buffer."""

    synchronize_checkpoint_boundary: bool = False
    """Synchronize the device at the start and end of each checkpointed forward and recomputation."""

    profile: bool = False
    """Log the time of each checkpointed forward and recomputation (logger ``zeroshard``)."""


class TensorBoardConfig(ConfigModel):
    """TensorBoard monitor."""

    enabled: bool = False
    """Log training metrics to TensorBoard."""

    output_path: str = ""
    """Directory of the event files (empty: under the launch directory)."""

    job_name: str = "DeepSpeedJobName"
    """Sub-directory name of this job inside ``output_path``."""


class CSVMonitorConfig(ConfigModel):
    """CSV-file monitor."""

    enabled: bool = False
    """Log training metrics to CSV files."""

    output_path: str = ""
    """Directory of the CSV files (empty: under the launch directory)."""

    job_name: str = "DeepSpeedJobName"
    """Sub-directory name of this job inside ``output_path``."""


class WandbConfig(ConfigModel):
    """Weights & Biases monitor."""

    enabled: bool = False
    """Log training metrics to Weights & Biases."""

    group: str | None = None
    """W&B group of the run."""

    team: str | None = None
    """W&B team (entity)."""

    project: str = "deepspeed"
    """W&B project name."""


class CometConfig(ConfigModel):
    """Comet monitor."""

    enabled: bool = False
    """Log training metrics to Comet."""

    samples_log_interval: Int = Field(default=100, gt=0)
    """Submit metrics every this many samples."""

    project: str | None = None
    """Comet project name."""

    workspace: str | None = None
    """Comet workspace."""

    api_key: str | None = None
    """Comet API key."""

    experiment_name: str | None = None
    """Name of the Comet experiment."""

    experiment_key: str | None = None
    """Key of an existing Comet experiment."""

    online: bool | None = None
    """Log to the Comet server (True) or store offline (False)."""

    mode: str | None = None
    """Experiment start mode: get, create or get_or_create."""


class FlopsProfilerConfig(ConfigModel):
    """FLOPs profiler."""

    enabled: bool = False
    """Profile the FLOPs of one training step."""

    recompute_fwd_factor: Float = Field(default=0.0, ge=0)
    """Fraction of the forward pass recomputed by activation checkpointing."""

    profile_step: Int = Field(default=1, ge=0)
    """Training step at which to profile, counted from 0 (the default 1 leaves one warm-up step)."""

    module_depth: Int = Field(default=-1, ge=-1)
    """Depth of the module tree to report (0: the model only; -1: all)."""

    top_modules: Int = Field(default=1, ge=1)
    """Number of top modules to report."""

    detailed: bool = True
    """Print the detailed per-module profile."""

    output_file: str | None = None
    """File to write the profile to (None: the ``zeroshard`` log, rank 0)."""

    peak_tflops: Float | None = Field(default=None, gt=0)
    """zeroshard extension (DeepSpeed has no such key): peak TFLOPS of one device for the model FLOPs
    utilisation (MFU). Unset: taken from a table of known devices (H100/H200 989, A100 312, dense
    bf16/fp16), else reported as unknown."""


class CommsLoggerConfig(ConfigModel):
    """Communication logger."""

    enabled: bool = False
    """Log collective operations."""

    verbose: bool = False
    """Log every collective as it happens."""

    prof_all: bool = True
    """Profile all collectives."""

    debug: bool = False
    """Include the calling function name in the log."""

    prof_ops: list[str] = Field(default_factory=list)
    """Names of the collectives to profile when ``prof_all`` is False."""


class ThroughputTimerConfig(ConfigModel):
    """DeepSpeed's ``timers.throughput``: the engine's ``tput_timer``."""

    enabled: bool = True
    """Count samples per second over the steps (``engine.tput_timer``)."""

    synchronized: bool = False
    """Synchronise the accelerator at each start and stop of the timer. DeepSpeed's default is true;
    zeroshard adds no device synchronisation to a step unless asked (its own step log times steps)."""


class TimersConfig(ConfigModel):
    """DeepSpeed's ``timers`` block."""

    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig)
    """The throughput timer."""


class AIOConfig(ConfigModel):
    """Asynchronous I/O settings for NVMe offload."""

    block_size: Int = Field(default=1_048_576, gt=0)
    """I/O block size in bytes."""

    queue_depth: Int = Field(default=8, gt=0)
    """I/O queue depth."""

    intra_op_parallelism: Int = Field(default=1, gt=0)
    """Number of I/O threads per operation."""

    single_submit: bool = False
    """Submit requests one at a time instead of in batches."""

    overlap_events: bool = True
    """Overlap submission and completion of I/O requests."""

    use_gds: bool = False
    """Use NVIDIA GPUDirect Storage."""
