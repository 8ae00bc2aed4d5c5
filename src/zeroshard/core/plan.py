"""The plan of a stage: where every piece of a rank's training state lives, decided once.

A pure function of the stage, the world size, the compute dtype, the offload choices and whether
training runs on an accelerator. The builder (:mod:`zeroshard.core.build`) constructs the parts it
names; the memory estimator (:mod:`zeroshard.estimate.residency`) reads the same plan, so the two
cannot disagree about which copies exist::

    stage 0   masters: the parameters (fp32) or a full copy; gradients all-reduced
    stage 1   masters and optimizer state sharded; full gradients reduce-scattered at the boundary
    stage 2   + gradient shard only, reduce-scattered every micro-step
    stage 3   + parameters sharded at rest (gathered from the masters, or from a compute-dtype shard)

Residencies come from the offload policy: masters (and the optimizer state beside them) on the
device, in host memory or in swap files; the ZeRO-3 parameter shard likewise. With partial
optimizer offload (``offload_optimizer.ratio`` below 1, stage 3) the masters are split: the leading
sub-groups on the device, the rest in host memory (``masters`` is then HOST, ``masters_split`` set);
the parameter shard is then a copy of its own, as with the masters wholly in host memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from zeroshard.core.offload.policy import Residency

__all__ = ["GradReduction", "StagePlan", "make_plan"]


class GradReduction(Enum):
    """How a stage reduces gradients."""

    #: stage 0: every rank all-reduces and keeps the whole gradient
    ALL_REDUCE = "all_reduce"
    #: stage 1: full gradients accumulate locally, reduce-scattered once per window
    REDUCE_SCATTER_AT_BOUNDARY = "reduce_scatter_at_boundary"
    #: stages 2-3: reduce-scattered every micro-step, only this rank's shard is kept
    REDUCE_SCATTER_EVERY_MICRO_STEP = "reduce_scatter_every_micro_step"


@dataclass(frozen=True)
class StagePlan:
    """Which parts a stage has and where each lives."""

    stage: int
    world: int
    #: ranks the flat layout is split over (1 at stage 0: every rank holds everything)
    layout_world: int
    #: masters and optimizer state: device, host memory or swap files
    masters: Residency
    #: the ZeRO-3 parameter shard: device, host memory or a swap file
    params: Residency
    #: fp32 stages 0-2 with masters in the parameters' memory: the masters *are* the parameters
    masters_alias_params: bool
    #: the masters live in swap files between steps (NVMe optimizer offload, not aliased)
    masters_swapped: bool
    #: partial optimizer offload: the leading sub-groups' masters and state on the device, the
    #: others at ``masters`` (host memory); which sub-groups, :meth:`OffloadPolicy.subgroup_residencies`
    masters_split: bool
    #: stages 1-2 with swapped masters: a compute-dtype shard in memory that all-gathers pack from
    compute_copy: bool
    #: stage 3: units are gathered (and cast) straight from the masters, no compute-dtype shard
    param_shard_aliases_masters: bool
    #: stage 3, fp32, masters in host memory on the CPU: a gathered unit's master row is lent to it
    lends_rows: bool
    reduction: GradReduction

    @property
    def sharded(self) -> bool:
        """Whether state is split across ranks (stage ≥ 1 on more than one rank)."""
        return self.stage >= 1 and self.world > 1

    @property
    def shards_parameters(self) -> bool:
        """Whether parameters are partitioned at rest and gathered per unit (stage 3)."""
        return self.stage == 3

    @property
    def shards_gradients(self) -> bool:
        """Whether only this rank's gradient shard persists between micro-steps (stages 2-3)."""
        return self.stage >= 2


def make_plan(stage: int, world: int, fp32: bool, masters: Residency, params: Residency,
              accelerator: bool, quantized_weights: bool = False, secondary_shards: bool = False,
              split_masters: bool = False) -> StagePlan:
    """The plan for ``stage`` on ``world`` ranks, computing in fp32 or not (``fp32``), with the
    masters and (ZeRO-3) parameter shard at the given residencies, on an accelerator or the CPU,
    gathering parameters quantized (ZeRO++ qwZ) or not, keeping hpZ's secondary shards or not,
    with the masters split between the device and host memory (``split_masters``: partial
    optimizer offload, stage 3 with ``masters`` HOST) or not."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    if split_masters and (stage != 3 or masters is not Residency.HOST):
        raise ValueError("partial optimizer offload splits the masters of stage 3 between the device and host "
                         f"memory, not stage {stage} with masters at {masters.value}")
    # Memory "kinds": on the CPU the device is the host, so host-resident state shares its memory.
    masters_in_device_memory = masters is Residency.DEVICE or not accelerator
    alias = fp32 and stage < 3 and masters_in_device_memory
    swapped = masters is Residency.FILE and not alias
    masters_memory = None if swapped else ("device" if masters is Residency.DEVICE or not accelerator else "host")
    shard_memory = "device" if params is Residency.DEVICE or not accelerator else "host"
    # The masters are where units are gathered from: gather (and cast on the way) from them rather
    # than keep a compute-dtype copy, as FSDP2 does; a cast across memories would be a copy anyway.
    # Split masters are two buffers (on an accelerator in two memories): the shard is one of its own,
    # as the masters wholly in host memory make it on an accelerator, also on the CPU, so that the
    # CPU runs the path an accelerator takes.
    shard_alias = (stage == 3 and params is not Residency.FILE and masters_memory == shard_memory
                   and (fp32 or shard_memory == "device") and not split_masters)
    reduction = {0: GradReduction.ALL_REDUCE, 1: GradReduction.REDUCE_SCATTER_AT_BOUNDARY}.get(
        stage, GradReduction.REDUCE_SCATTER_EVERY_MICRO_STEP)
    return StagePlan(
        stage=stage, world=world, layout_world=world if stage >= 1 else 1, masters=masters, params=params,
        masters_alias_params=alias, masters_swapped=swapped, masters_split=split_masters,
        compute_copy=swapped and stage < 3,
        param_shard_aliases_masters=shard_alias,
        # A quantized gather's values are no copy of the row: nothing to lend. hpZ gathers again
        # from secondary shards, not from the row: lending is kept to the plain path.
        lends_rows=(stage == 3 and fp32 and not accelerator and masters is not Residency.FILE
                    and params is not Residency.FILE and not quantized_weights and not secondary_shards
                    and not split_masters),
        reduction=reduction)
