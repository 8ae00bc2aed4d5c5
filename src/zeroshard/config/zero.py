"""The ``zero_optimization`` block and its offload sub-blocks.

Key names and defaults follow DeepSpeed 0.19.x (``deepspeed/runtime/zero/config.py`` and
``deepspeed/runtime/zero/offload_config.py``). The ``stage3_*`` keys use their DeepSpeed JSON names;
DeepSpeed's short field names (``max_live_parameters``...) are accepted as aliases by the loader.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from zeroshard.config.fields import ConfigModel, Float, Int

__all__ = ["DEFAULT_LEAF_MODULE_CLASSES", "LeafModuleConfig", "OffloadDevice", "OffloadOptimizerConfig",
           "OffloadParamConfig", "ZeroConfig"]

OffloadDevice = Literal["none", "cpu", "nvme"]


class OffloadOptimizerConfig(ConfigModel):
    """Offload of optimizer state (and the optimizer step) to CPU or NVMe."""

    device: OffloadDevice = "none"
    """Where optimizer state lives: ``none`` (accelerator), ``cpu`` or ``nvme``."""

    nvme_path: Path | None = None
    """Directory on the NVMe device used for optimizer-state swapping (required with ``device: nvme``)."""

    pin_memory: bool = True
    """Use page-locked CPU memory for offloaded state (DeepSpeed 0.19 default: True)."""

    buffer_count: Int = Field(default=4, ge=0)
    """Number of buffers in the NVMe swap buffer pool (at least the optimizer's per-parameter states)."""

    fast_init: bool = False
    """Fast optimizer initialization when offloading to NVMe."""

    ratio: Float = Field(default=1.0, ge=0.0, le=1.0)
    """Fraction of the optimizer's sub-groups offloaded (ZeRO-Offload++): below 1.0 the leading ones stay on
    the device. Only with ZeRO stage 3 and ``device: cpu`` (DeepSpeed's meaning and rounding)."""


class OffloadParamConfig(ConfigModel):
    """Offload of model parameters to CPU or NVMe (ZeRO stage 3 only)."""

    device: OffloadDevice = "none"
    """Where partitioned parameters live: ``none`` (accelerator), ``cpu`` or ``nvme``."""

    nvme_path: Path | None = None
    """Directory on the NVMe device used for parameter swapping (required with ``device: nvme``)."""

    pin_memory: bool = True
    """Use page-locked CPU memory for offloaded parameters (DeepSpeed 0.19 default: True)."""

    buffer_count: Int = Field(default=5, ge=0)
    """Number of buffers in the NVMe parameter swap buffer pool."""

    buffer_size: Int = Field(default=100_000_000, ge=0)
    """Size in elements of each NVMe parameter swap buffer."""

    max_in_cpu: Int = Field(default=1_000_000_000, ge=0)
    """Number of parameter elements kept in CPU memory when offloading to NVMe."""


#: DeepSpeed 0.19's default ``zero_optimization.leaf_module.classes``: Hugging Face's MoE sparse blocks
DEFAULT_LEAF_MODULE_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


class LeafModuleConfig(ConfigModel):
    """ZeRO-3 leaf modules, gathered whole with their subtree (``zeroshard.deepspeed.utils.set_z3_leaf_modules``).

    A single string is read as a list of one, as DeepSpeed does."""

    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    """Class names, plain or qualified (DeepSpeed 0.19's default: Hugging Face's MoE sparse blocks)."""

    names: list[str] = Field(default_factory=list)
    """Module names as ``model.named_modules()`` gives them."""

    name_suffixes: list[str] = Field(default_factory=list)
    """Ends of module names (``"mlp.experts"``)."""

    @model_validator(mode="before")
    @classmethod
    def _one_string_is_a_list(cls, values: object) -> object:
        if isinstance(values, dict):
            return {k: [v] if k in ("classes", "names", "name_suffixes") and isinstance(v, str) else v
                    for k, v in values.items()}
        return values


class ZeroConfig(ConfigModel):
    """ZeRO partitioning: stage, communication buckets, overlap and stage-3 knobs."""

    stage: Int = Field(default=0, ge=0, le=3)
    """ZeRO stage: 0 disabled, 1 optimizer state, 2 + gradients, 3 + parameters partitioned."""

    contiguous_gradients: bool = True
    """Copy gradients into a contiguous buffer as they are produced (avoids fragmentation)."""

    reduce_scatter: bool = True
    """Average gradients with reduce/reduce-scatter instead of all-reduce."""

    reduce_bucket_size: Int = Field(default=500_000_000, gt=0)
    """Number of gradient elements reduced at a time."""

    allgather_partitions: bool = True
    """Gather updated parameters with all-gather (True) or a series of broadcasts (False)."""

    allgather_bucket_size: Int = Field(default=500_000_000, gt=0)
    """Number of parameter elements all-gathered at a time (must be > 0; DeepSpeed allows 0)."""

    overlap_comm: bool | None = None
    """Overlap gradient reduction with the backward pass. Unset (None) resolves to True for stage 3 and
    False otherwise, as in DeepSpeed; after loading it is always a bool."""

    round_robin_gradients: bool = False
    """Stage 1/2 with CPU offload: parallelize gradient copies to CPU across ranks."""

    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig)
    """Optimizer-state offload settings (DeepSpeed's default None is represented as ``device: none``)."""

    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig)
    """Parameter offload settings, stage 3 only (DeepSpeed's None is represented as ``device: none``)."""

    @field_validator("offload_optimizer", "offload_param", mode="before")
    @classmethod
    def _null_is_no_offload(cls, value: object) -> object:
        return {} if value is None else value  # DeepSpeed's default for both blocks is null

    sub_group_size: Int = Field(default=1_000_000_000, ge=0)
    """Number of parameter elements per optimizer-step tile (stage 3 offload / ZeRO-Infinity)."""

    stage3_max_live_parameters: Int = Field(default=1_000_000_000, ge=0)
    """Stage 3: maximum number of gathered parameter elements resident per rank before releasing."""

    stage3_max_reuse_distance: Int = Field(default=1_000_000_000, ge=0)
    """Stage 3: do not release a parameter that will be reused within this many parameter elements."""

    stage3_prefetch_bucket_size: Int = Field(default=50_000_000, ge=0)
    """Stage 3: maximum number of parameter elements prefetched ahead of use."""

    stage3_param_persistence_threshold: Int = Field(default=100_000, ge=0)
    """Stage 3: parameters with fewer elements than this stay unpartitioned."""

    stage3_module_granularity_threshold: Int = Field(default=0, ge=0)
    """Stage 3: modules whose parameters per layer (their own and their descendants', over the number
    of those modules with parameters) are at most this many elements are gathered whole, as leaves
    (DeepSpeed's meaning): fewer, larger collectives for blocks of small layers. 0: none."""

    pipeline_loading_checkpoint: bool = False
    """Stage 3 in DeepSpeed: the local ranks load a checkpoint one after another, to bound host memory."""

    stage3_model_persistence_threshold: Int = Field(default=sys.maxsize, ge=0)
    """Stage 3: cap on the total number of elements kept unpartitioned by the persistence threshold."""

    stage3_gather_16bit_weights_on_model_save: bool = False
    """Stage 3: gather the 16-bit weights when saving the model (alias
    ``gather_16bit_weights_on_model_save``)."""

    elastic_checkpoint: bool = False
    """Legacy elastic checkpointing of stage 1/2 optimizer state."""

    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
    """Stage 3: modules gathered whole with their subtree (mixture-of-experts blocks)."""

    zero_quantized_weights: bool = False
    """ZeRO++ qwZ (stage 3): parameter all-gathers carry blockwise int8 values and their scales
    instead of the compute dtype; the fp32 masters and the step stay exact."""

    zero_quantized_gradients: bool = False
    """ZeRO++ qgZ (stages 2-3): gradients are reduced by quantized all-to-alls, inside each node
    first and then across nodes, and summed in fp32."""

    zero_hpz_partition_size: Int = Field(default=1, ge=0)
    """ZeRO++ hpZ (stage 3): after a unit's forward gather each rank keeps a secondary shard over
    this many consecutive ranks of its node, and the backward gathers from inside the node only.
    0 and 1 turn it off (DeepSpeed's default 1)."""

    hybrid_shard_size: Int = Field(default=0, ge=0)
    """zeroshard's hybrid sharding (stages 1-3): the training state is sharded inside groups of
    this many consecutive ranks and replicated across the groups, gradients reduce-scattered inside
    a group and all-reduced across (FSDP2's HSDP: ``fully_shard`` on a 2-D ``DeviceMesh`` of
    replicate x shard; torchtitan's ``data_parallel_replicate_degree``). 0: shard over the whole
    world. DeepSpeed 0.19.8 has no equivalent (it removed MiCS and refuses ``mics_shard_size``)."""

    ignore_unused_parameters: bool = True
    """Tolerate parameters that receive no gradient in a step instead of raising an error."""

    @model_validator(mode="after")
    def _resolve_overlap_comm(self) -> ZeroConfig:
        if self.overlap_comm is None:
            self.overlap_comm = self.stage == 3
        return self
