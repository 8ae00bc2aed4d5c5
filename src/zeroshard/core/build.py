"""Builds a stage from its plan: each part constructed once, with its collaborators and callbacks.

The order follows the dependencies, so that nothing is assigned into another object afterwards::

    buckets ─ master ─┬─ (stage 3) parameter shard ─ frozen shard ─ row lender ─ units ─ coordinator ─ counter
                      └─ state store (publish into the shard, reclaim lent rows) ─ gradient sync (reports
                         each parameter to the counter) ─ the stage

Everything built before a failure is closed again (swap files, I/O threads): a failed
``initialize`` leaves nothing behind.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.core.clock import StepClock
from zeroshard.core.comm import collectives as C
from zeroshard.core.comm.quantized import QuantizedReduction, deepspeed_qwz_block_size
from zeroshard.core.comm.topology import make_hpz_group, make_topology
from zeroshard.core.grad_sync import (
    AllReduceSync,
    BoundaryReduceScatterSync,
    GradSync,
    MicroStepReduceScatterSync,
)
from zeroshard.core.master import KeptPrefix, MasterShard
from zeroshard.core.offload import OffloadPolicy, Residency
from zeroshard.core.offload.factory import make_state_store, optimizer_state_device
from zeroshard.core.offload.param_store import ParamShard, make_param_shard
from zeroshard.core.offload.policy import should_pin
from zeroshard.core.offload.state_store import subgroup_runs
from zeroshard.core.offload.swapped_store import SwappedStateStore
from zeroshard.core.partition import Bucket, buckets_from_groups, buffer_numel, make_buckets, merge_buckets
from zeroshard.core.plan import GradReduction, StagePlan, make_plan
from zeroshard.core.precision import LossScaler, PrecisionPolicy
from zeroshard.core.seam import NO_OBSERVER, ParamObserver, set_owner
from zeroshard.core.zero3.coordinator import ParamCoordinator
from zeroshard.core.zero3.frozen import FrozenShard, frozen_to_partition
from zeroshard.core.zero3.lent_rows import RowLender
from zeroshard.core.zero3.param_unit import ParamUnit
from zeroshard.core.zero3.secondary import SecondaryShards
from zeroshard.core.zero3.stage3 import Stage3Optimizer, UnitGradCounter, Zero3Parts
from zeroshard.core.zero3.units import unit_groups
from zeroshard.core.zero_optimizer import StageParts, StageSpec, ZeroOptimizer

__all__ = ["build_stage", "plan_for"]

logger = logging.getLogger("zeroshard")

_SYNC: dict[GradReduction, type[GradSync]] = {
    GradReduction.ALL_REDUCE: AllReduceSync,
    GradReduction.REDUCE_SCATTER_AT_BOUNDARY: BoundaryReduceScatterSync,
    GradReduction.REDUCE_SCATTER_EVERY_MICRO_STEP: MicroStepReduceScatterSync,
}


def plan_for(spec: StageSpec, policy: PrecisionPolicy, offload: OffloadPolicy, device: torch.device,
             world: int) -> StagePlan:
    """The plan of the stage ``spec`` asks for, on ``device`` with ``world`` ranks."""
    return make_plan(spec.stage, world, policy.param_dtype == torch.float32, offload.optimizer, offload.params,
                     accelerator=device.type != "cpu", quantized_weights=spec.quantized_weights,
                     secondary_shards=spec.hpz_partition_size > 1, split_masters=offload.partial)


def build_stage(module: torch.nn.Module, param_groups: list[dict[str, Any]], spec: StageSpec,
                policy: PrecisionPolicy, scaler: LossScaler, group: dist.ProcessGroup | None,
                device: torch.device, offload: OffloadPolicy, *, scaling: tuple[float, float] | None = None,
                trains: bool = True, clock: StepClock | None = None,
                observer: ParamObserver = NO_OBSERVER,
                kinds: tuple[type[ZeroOptimizer], type[Stage3Optimizer]] = (ZeroOptimizer, Stage3Optimizer),
                replicate: dist.ProcessGroup | None = None) -> ZeroOptimizer:
    """The stage ``spec`` asks for, over the trained parameters of ``param_groups``.

    Args:
        module: the model (stage 3 partitions its frozen parameters too and hooks its modules).
        param_groups: the trained parameters, in torch optimizer param groups.
        spec, policy, scaler, offload: what the config asks (stage, dtypes, loss scaling, residency).
        group, device: the data-parallel group and the training device.
        scaling: ``(pre, post)`` factors around the gradient reduction (``None``: the stage's own).
        trains: whether an optimizer will step (an engine without one releases units after forwards).
        clock: the engine's step counter, named by the core's errors.
        observer: told of parameters partitioned and of unit state changes (stage 3).
        kinds: the classes built for stages 0-2 and for stage 3 (subclasses add names layers above
            the core want, as DeepSpeed's optimizer attributes: :mod:`zeroshard.deepspeed.optimizer`).
        replicate: hybrid sharding: ``group`` is this rank's sharding group and ``replicate`` the
            ranks holding the same shard in the other groups (gradients are all-reduced over them).
    """
    world = C.world_size(group)
    plan = plan_for(spec, policy, offload, device, world)
    params = [p for g in param_groups for p in g["params"]]
    for p in params:
        if not p.is_contiguous():
            p.data = p.data.contiguous()
    offload = offload.for_shard(-(-sum(p.numel() for p in params) // plan.layout_world))
    buckets = (buckets_from_groups(unit_groups(module, set(params)), world) if plan.shards_parameters
               else _stage_buckets(plan, spec, offload, params))
    rank = C.rank(group)
    master_device = optimizer_state_device(offload, device)
    pin = should_pin(offload.pin_memory, device)
    # Partial offload: each sub-group's residency, decided once; the masters are split to match.
    residencies, kept = _optimizer_split(buckets, offload, device, rank) if plan.masters_split else (None, None)
    master = MasterShard(buckets, rank if plan.layout_world > 1 else 0, master_device,
                         alias_params=plan.masters_alias_params, swapped=plan.masters_swapped, pin=pin,
                         droppable=plan.lends_rows, comm_device=device,
                         pack_dtype=policy.param_dtype if plan.compute_copy else None, kept=kept)
    sync_args = (group, policy, device, spec.overlap_comm)
    quantized = _quantized_reduction(group, device) if spec.quantized_gradients else None
    with ExitStack() as undo:  # closes what was built if a later part fails
        if not plan.shards_parameters:
            publish = functools.partial(_copy_range, master.pack_source) if plan.compute_copy else None
            store = make_state_store(master, offload, device, rank, publish=publish, residencies=residencies)
            undo.callback(store.close)
            sync = (MicroStepReduceScatterSync(buckets, *sync_args, acc_device=master_device, scaling=scaling,
                                               quantized=quantized, replicate=replicate, spill_dir=_spill_dir(store))
                    if plan.reduction is GradReduction.REDUCE_SCATTER_EVERY_MICRO_STEP else
                    _SYNC[plan.reduction](buckets, *sync_args, acc_device=master_device, scaling=scaling,
                                          replicate=replicate))
            undo.callback(sync.remove_hooks)
            stage = kinds[0](param_groups, spec, policy, scaler, group, device, offload,
                             StageParts(buckets, master, store, sync, plan))
        else:
            shard, frozen, lender = _zero3_storage(module, spec, policy, group, device, offload, buckets, master,
                                                   undo, clock=clock, observer=observer)
            # Before the units adopt the parameters: a swapped store writes their initial values.
            store = make_state_store(master, offload, device, rank, publish=None if shard.aliased else shard.publish,
                                     before_access=lender.reclaim_all if lender is not None else None,
                                     residencies=residencies)
            undo.callback(store.close)
            zero3 = _zero3_units(module, spec, policy, group, device, buckets, shard, frozen, lender, undo,
                                 trains=trains, clock=clock, observer=observer,
                                 before_gather=_stepping_first(store) if isinstance(store, SwappedStateStore) else None)
            # One reduce-scatter per run of units up to a reduce buffer (half of reduce_bucket_size),
            # not one per unit: units are single modules, often far smaller (DeepSpeed buckets them too).
            # Launched as each unit completes, not in bucket order: its all-gathers already require
            # every rank to run modules in the same order.
            sync = MicroStepReduceScatterSync(merge_buckets(buckets, buffer_numel(spec.reduce_bucket_size)),
                                              *sync_args, acc_device=master_device, scaling=scaling,
                                              ordered=False, on_param_done=zero3.grads.param_done, quantized=quantized,
                                              replicate=replicate, spill_dir=_spill_dir(store))
            undo.callback(sync.remove_hooks)
            stage = kinds[1](module, param_groups, spec, policy, scaler, group, device, offload,
                             StageParts(buckets, master, store, sync, plan), zero3)
            _warn_frozen_whole(module, zero3.grads.trained() | set(zero3.frozen.ranges if zero3.frozen else ()),
                               rank)
            for p in zero3.frozen.ranges if zero3.frozen is not None else ():
                set_owner(p, stage)  # found by GatheredParameters
        undo.pop_all()
    for p in params:
        set_owner(p, stage)
    return stage


def _optimizer_split(buckets: list[Bucket], offload: OffloadPolicy, device: torch.device,
                     rank: int) -> tuple[tuple[Residency, ...], KeptPrefix]:
    """Partial optimizer offload: each sub-group's residency (:meth:`OffloadPolicy.subgroup_residencies`),
    and the masters that stay on ``device``, those of the sub-groups kept there (the leading ones)."""
    runs = subgroup_runs(buckets, offload.sub_group)
    residencies = offload.subgroup_residencies(len(runs))
    kept = sum(r is Residency.DEVICE for r in residencies)
    total = sum(b.numel for b in buckets)
    end = runs[kept][0].start if kept < len(runs) else total
    if rank == 0:
        logger.info("zeroshard: partial optimizer offload (ratio %g): %d of %d sub-groups (%d of %d elements) stay "
                    "on the device", offload.ratio, kept, len(runs), end, total)
        if kept == 0:
            logger.warning("zeroshard: offload_optimizer.ratio %g keeps none of this rank's %d optimizer sub-group(s) "
                           "on the device (as DeepSpeed counts them: int((1 - ratio) * sub-groups)), so all of the "
                           "optimizer state is offloaded; lower zero_optimization.sub_group_size (now %d) to split it",
                           offload.ratio, len(runs), offload.sub_group)
    return residencies, KeptPrefix(end, device)


def _quantized_reduction(group: dist.ProcessGroup | None, device: torch.device) -> QuantizedReduction:
    """ZeRO++ qgZ over the data-parallel world's two levels (one when it is one node)."""
    topology = make_topology(group, device)
    return QuantizedReduction(topology.intra, topology.inter)


def _spill_dir(store: object) -> Path | None:
    """NVMe optimizer offload: where the gradient shard spills (beside the optimizer's swap files),
    so that host memory does not grow with the model (:class:`~zeroshard.core.host_memory.FileMappedBuffer`)."""
    return store.directory if isinstance(store, SwappedStateStore) else None


def _secondary_shards(group: dist.ProcessGroup | None, device: torch.device, size: int) -> SecondaryShards:
    """ZeRO++ hpZ: this rank's group of ``size`` consecutive ranks inside its node."""
    hpz = make_hpz_group(group, device, size)
    return SecondaryShards(hpz, size, C.rank(hpz), C.world_size(group))


def _stage_buckets(plan: StagePlan, spec: StageSpec, offload: OffloadPolicy,
                   params: list[torch.nn.Parameter]) -> list[Bucket]:
    """Stages 0-2: buckets of up to ``reduce_bucket_size`` elements in reverse registration order
    (which approximates the order backward produces gradients in)."""
    size = buffer_numel(spec.reduce_bucket_size) if plan.shards_gradients else spec.reduce_bucket_size
    if offload.optimizer is Residency.FILE:
        # A sub-group is a run of whole buckets: buckets no larger than it keep the host memory
        # of the step at sub_group_size (DeepSpeed's reduce_bucket_size of 5e8 made one sub-group
        # of the whole shard, all of it in host memory).
        size = min(size, offload.sub_group * plan.layout_world)
    return make_buckets(list(reversed(params)), plan.layout_world, size)


def _zero3_storage(module: torch.nn.Module, spec: StageSpec, policy: PrecisionPolicy,
                   group: dist.ProcessGroup | None, device: torch.device, offload: OffloadPolicy,
                   buckets: list[Bucket], master: MasterShard, undo: ExitStack, *, clock: StepClock | None,
                   observer: ParamObserver) -> tuple[ParamShard, FrozenShard | None, RowLender | None]:
    """Stage 3's storage: the parameter shard, the frozen parameters' shard and the row lender."""
    rank = C.rank(group)
    shard = make_param_shard(master, buckets, offload, policy.param_dtype, device, rank, clock)
    undo.callback(shard.close)
    frozen: FrozenShard | None = None
    frozen_params = frozen_to_partition(module, set(master.views))
    if frozen_params:
        frozen = FrozenShard(module, frozen_params, group, rank, C.world_size(group), policy.param_dtype, device,
                             offload, spec.param_persistence_threshold, observer=observer, clock=clock)
        undo.callback(frozen.close)
    released = sum(n for n in map(_numel, buckets) if n > spec.param_persistence_threshold)
    released += sum(u.numel for u in (frozen.units if frozen else []) if not u.persistent)
    # Only when the live budget holds the model (DeepSpeed's default for models up to 1e9
    # parameters): each unit is then gathered once per pass, held to the end of its backward, and
    # its row written back once. Under a smaller budget units are gathered again in backward, each
    # time costing a write-back and page faults, to save 1/N of the few units the budget holds.
    lends = shard.aliased and master.droppable and spec.max_live_parameters >= released
    lender = RowLender(master.drop_pages, rank, {p: n for n, p in module.named_parameters()}) if lends else None
    return shard, frozen, lender


def _zero3_units(module: torch.nn.Module, spec: StageSpec, policy: PrecisionPolicy, group: dist.ProcessGroup | None,
                 device: torch.device, buckets: list[Bucket], shard: ParamShard, frozen: FrozenShard | None,
                 lender: RowLender | None, undo: ExitStack, *, trains: bool, clock: StepClock | None,
                 observer: ParamObserver, before_gather: Callable[[ParamUnit], None] | None = None) -> Zero3Parts:
    """Stage 3's units, which adopt the trained parameters, and the coordinator that gathers them
    (calling ``before_gather`` with each unit about to be gathered)."""
    names = {p: n for n, p in module.named_parameters()}
    secondaries = _secondary_shards(group, device, spec.hpz_partition_size) if spec.hpz_partition_size > 1 else None
    units = []
    for b in buckets:
        keep = _numel(b) <= spec.param_persistence_threshold
        # Trained units only lend (a frozen one has no master row), and not the persistent ones:
        # they are gathered while the optimizer reads the row.
        units.append(ParamUnit(b, shard.unit_view(b), group, persistent=keep, name=names.get(b.params[0], "?"),
                               device=device, swap=shard.swap, dtype=policy.param_dtype,
                               lender=None if keep else lender, observer=observer,
                               quantize_block=deepspeed_qwz_block_size(b.numel) if spec.quantized_weights else None,
                               secondaries=None if keep else secondaries))
    for u in units:
        u.adopt()
    coordinator = ParamCoordinator(module, units + (frozen.units if frozen else []), spec.max_live_parameters,
                                   spec.prefetch_bucket_size, release_after_forward=not trains, clock=clock,
                                   before_gather=before_gather)
    undo.callback(coordinator.remove_hooks)
    coordinator.gather_persistent()
    return Zero3Parts(shard, units, frozen, lender, coordinator, UnitGradCounter(units, coordinator), secondaries)


def _stepping_first(store: SwappedStateStore) -> Callable[[ParamUnit], None]:
    """ZeRO-3 with swapped optimizer state: a trained unit is gathered only once the optimizer
    step its masters are in has stepped and published them (the step runs as the next forward
    gathers, so that its reads and writes overlap that forward; :meth:`SwappedStateStore.begin_step`)."""
    def step_first(u: ParamUnit) -> None:
        if not u.frozen:
            store.step_through(u.bucket.index)

    return step_first


def _numel(b: Bucket) -> int:
    """Elements of the parameters of ``b`` (padding excluded)."""
    return sum(lay.numel for lay in b.layouts)


def _copy_range(target: torch.Tensor, a: int, b: int, values: torch.Tensor) -> None:
    # Asynchronous from page-locked memory; the swapped store waits for it before refilling a buffer.
    target[a:b].copy_(values, non_blocking=True)


def _warn_frozen_whole(module: torch.nn.Module, partitioned: set[torch.nn.Parameter], rank: int) -> None:
    """Say how much of the model stage 3 leaves whole on every rank: parameters outside the
    optimizer that still require gradients (autograd would write a full ``.grad`` into them)."""
    whole = [p for p in dict.fromkeys(module.parameters()) if p not in partitioned]
    if not whole or rank != 0:
        return
    nbytes = sum(p.numel() * p.element_size() for p in whole)
    logger.warning(
        "zeroshard: %d parameter(s) (%.1f MiB) require gradients but are not in model_parameters: ZeRO stage 3 "
        "keeps them whole on every rank and never updates them. Set requires_grad=False on parameters that "
        "are not trained (a frozen base model) so that they are partitioned", len(whole), nbytes / 2**20)
