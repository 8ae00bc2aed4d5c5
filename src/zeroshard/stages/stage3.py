"""ZeRO stage 3: stage 2 plus parameters partitioned at rest and gathered per unit.

Design note
-----------
Units are modules' direct parameters (a parameter shared by several modules belongs to the
first), or a whole subtree for modules marked with ``set_z3_leaf_modules``. Each unit is one
bucket of the usual per-parameter chunk layout, so the fp32 master
shard, the gradient shard and the compute-dtype parameter shard are three flat buffers with the
same geometry: after the optimizer step the new parameter shard is a cast of the master shard, no
collective needed. Forward and backward gather units through :class:`ParamCoordinator`. A unit is
released as soon as all its gradients are written; gradients are reduce-scattered by runs of
consecutive units up to ``reduce_bucket_size`` (one collective for many small modules), each run
as soon as it is complete.

Parameters that are not trained (``requires_grad=False``, outside the optimizer: a LoRA base
model) are partitioned too, in units of their own with a compute-dtype shard and no master
(:mod:`~zeroshard.stages.frozen`), gathered and released by the same coordinator.

Memory residency per rank (Ψ parameters, N ranks, 16-bit compute, Adam, gradients accumulated in
the compute dtype): parameter shard 2Ψ/N + gradient shard 2Ψ/N + master 4Ψ/N + Adam 8Ψ/N = 16Ψ/N,
plus the gathered units (bounded by ``stage3_max_live_parameters`` and the units in use) and the
persistent small units. With fp32 compute the parameter shard *is* the master shard, and in host
memory a gathered unit's row of it is handed back to the system while the unit holds a copy
(:mod:`~zeroshard.stages.lent_rows`): the rank then holds its chunk once, not twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zeroshard import host_memory
from zeroshard.offload import OffloadPolicy
from zeroshard.offload.param_store import make_param_shard
from zeroshard.offload.policy import Residency
from zeroshard.optim.no_optimizer import NoOptimizer
from zeroshard.partition import (
    UNIT_ATTR,
    Bucket,
    buckets_from_groups,
    buffer_numel,
    merge_buckets,
)
from zeroshard.precision import LossScaler, PrecisionPolicy
from zeroshard.stages.coordinator import ParamCoordinator
from zeroshard.stages.frozen import FrozenShard, frozen_to_partition
from zeroshard.stages.grad_sync import MicroStepReduceScatterSync
from zeroshard.stages.lent_rows import RowLender
from zeroshard.stages.param_unit import ParamUnit
from zeroshard.stages.parameter_offload import ParameterOffload
from zeroshard.stages.units import unit_groups
from zeroshard.stages.zero_optimizer import StageSpec, ZeroOptimizer, in_memory_bytes
from zeroshard.zero.external import add_external_parameters_accessor

logger = logging.getLogger("zeroshard")


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


class Stage3Optimizer(ZeroOptimizer):
    """The optimizer ``initialize`` returns for ZeRO stage 3; it also owns the parameter units."""

    def __init__(self, module: torch.nn.Module, param_groups: list[dict[str, Any]], spec: StageSpec,
                 policy: PrecisionPolicy, scaler: LossScaler, group: dist.ProcessGroup | None,
                 device: torch.device, offload: OffloadPolicy | None = None) -> None:
        self.module = module
        self.lender: RowLender | None = None
        super().__init__(param_groups, spec, policy, scaler, group, device, offload)
        dtype = policy.param_dtype
        #: the compute-dtype shard, where the offload policy puts it (device, host or a file)
        try:
            self.shard = make_param_shard(self.master, self.buckets, self.offload, dtype, device, self.rank)
        except BaseException:
            self.store.close()  # its swap files were made under a good path: do not leave them
            raise
        if not self.shard.aliased:
            self.store.publish = self.shard.publish
        names = {p: n for n, p in module.named_parameters()}
        self.units = [
            ParamUnit(b, self.shard.unit_view(b), group,
                      persistent=sum(lay.numel for lay in b.layouts) <= spec.param_persistence_threshold,
                      name=names.get(b.params[0], "?"), device=device, swap=self.shard.swap, dtype=dtype)
            for b in self.buckets
        ]
        for u in self.units:
            u.adopt()
        #: the frozen parameters' chunks and units (``None`` when every parameter trains)
        self.frozen: FrozenShard | None = None
        frozen = frozen_to_partition(module, set(self.master.views))
        if frozen:
            try:
                self.frozen = FrozenShard(module, frozen, group, self.rank, self.world, dtype, device, self.offload,
                                          spec.param_persistence_threshold)
            except BaseException:
                self.close()
                raise
            for p in frozen:
                p._zeroshard_owner = self  # type: ignore[attr-defined]  # found by GatheredParameters
        frozen_units = self.frozen.units if self.frozen is not None else []
        released = [u for u in self.units if not u.persistent]
        # droppable: the masters are fp32 in host memory where units are gathered (_lends_rows)
        if (self.shard.aliased and self.master.droppable
                and spec.max_live_parameters >= sum(u.numel for u in released + frozen_units if not u.persistent)):
            # Only when the live budget holds the model (DeepSpeed's default for models up to 1e9
            # parameters): each unit is then gathered once per pass, held to the end of its
            # backward, and its row written back once. Under a smaller budget units are gathered
            # again in backward, each time costing a write-back and page faults, to save 1/N of
            # the few units the budget holds.
            self.lender = RowLender(self.master.drop_pages, self.rank, names)
            # Trained units only (a frozen one has no master row), and not the persistent ones:
            # they are gathered while the optimizer reads the row.
            for u in released:
                u.lender = self.lender
            self.store.before_access = self.lender.reclaim_all
        self.coordinator = ParamCoordinator(module, self.units + frozen_units, spec.max_live_parameters,
                                            spec.prefetch_bucket_size)
        self.coordinator.gather_persistent()
        #: DeepSpeed's name for the owner of the module hooks (TRL removes and re-adds them)
        self.parameter_offload = ParameterOffload(self.coordinator, module)
        add_external_parameters_accessor(module)
        self._unit_of = {p: u for u in self.units for p in u.params}
        _warn_frozen_whole(module, set(self._unit_of) | set(self.frozen.ranges if self.frozen else ()), self.rank)
        self._grads_missing: dict[ParamUnit, int] = {}
        self.sync.ordered = False
        self.sync.on_param_done = self._param_done
        assert isinstance(self.sync, MicroStepReduceScatterSync)

    def _lends_rows(self, master_device: torch.device) -> bool:
        """fp32 with the masters in host memory where parameters are gathered: a gathered unit holds
        an exact copy of its row, which the master buffer can then lend it
        (:mod:`~zeroshard.stages.lent_rows`)."""
        return (self.policy.param_dtype == torch.float32 and master_device == self.device
                and self.device.type == "cpu" and self.offload.params is not Residency.FILE)

    def _make_buckets(self, params: list[torch.nn.Parameter]) -> list[Bucket]:
        return buckets_from_groups(unit_groups(self.module, set(params)), self.world)

    def _sync_buckets(self) -> list[Bucket]:
        # One reduce-scatter per run of units up to a reduce buffer (half of reduce_bucket_size),
        # not one per unit: units are single modules, often far smaller (DeepSpeed buckets them too).
        return merge_buckets(self.buckets, buffer_numel(self.spec.reduce_bucket_size))

    def _grad_views(self) -> list[torch.Tensor]:
        self.sync.shard_grads()  # zeroes what no backward reduced in this window
        # The reduction buckets span several units; the shard accumulator is in layout order.
        acc = self.sync.accumulator()  # type: ignore[attr-defined]
        return [acc[b.start : b.start + b.numel] for b in self.buckets]

    def start_backward(self, boundary: bool) -> None:
        """Count the gradients each unit still waits for in this backward."""
        super().start_backward(boundary)
        self._grads_missing = {u: len(u.params) for u in self.units}

    def _backward_reads_parameter_files(self) -> bool:
        """Only a unit released since its forward is read again: when every unit is still gathered
        (a live budget that holds the model, DeepSpeed's default for models under 1e9 parameters),
        backward leaves the disk to the optimizer state read ahead for the step."""
        if self.offload.params is not Residency.FILE:
            return False
        return any(not u.persistent and u not in self.coordinator.live for u in self.coordinator.units)

    def _param_done(self, p: torch.nn.Parameter) -> None:
        u = self._unit_of[p]
        self._grads_missing[u] = self._grads_missing.get(u, len(u.params)) - 1
        if self._grads_missing[u] == 0:  # no parameter of the unit is needed again this pass
            self.coordinator.unit_grads_done(u)

    def finish_backward(self) -> None:
        """Complete the gradient collectives, then release every non-persistent unit."""
        self.sync.finish_backward()
        self.coordinator.end_of_pass()
        host_memory.trim(self.device, site="step")

    def _begin_publish(self) -> None:
        """Nothing to gather: the store publishes each stepped sub-group into the parameter shard."""
        return None

    def publish(self) -> None:
        """Refresh the 16-bit shard from the masters and drop stale gathered copies."""
        self.store.refresh()  # a no-op right after a step: it published each sub-group as it went
        self.shard.flush()  # parameter swap-file writes in flight end here, their errors with them
        with torch.no_grad():
            # Anything still gathered (eval forwards, persistent units) is stale now.
            # Frozen units change only when a checkpoint is loaded into them.
            for u in self.units + (self.frozen.stale_units() if self.frozen is not None else []):
                self.coordinator.live.pop(u, None)
                # Persistent units are visible between steps: user code may hold their tensors.
                u.release(free_storage=not u.persistent)
            self.coordinator.gather_persistent()

    def write_back(self, p: torch.nn.Parameter) -> None:
        """Write the gathered value of ``p`` into this rank's master and parameter shards (a frozen
        parameter: into its chunk)."""
        if self.frozen is not None and p in self.frozen.ranges:
            s, e = self.frozen.ranges[p]
            self.frozen.write(p, p.detach().reshape(-1)[s:e])
            return
        super().write_back(p)
        unit: ParamUnit = getattr(p, UNIT_ATTR)
        i = unit.position(p)
        s, e = self.master.ranges[p]
        off = unit.bucket.offsets[i]
        with torch.no_grad():
            unit.write_shard(off, p.detach().reshape(-1)[s:e])

    def gather_context(self, params: list[torch.nn.Parameter]) -> tuple[Callable[[], None], Callable[[], None]]:
        """``(enter, exit)``: gather and pin the units of ``params``; unpin and release on exit."""
        units = list(dict.fromkeys(getattr(p, UNIT_ATTR) for p in params))
        return (lambda: self.coordinator.fetch(units, record=False)), (lambda: self.coordinator.unpin(units))

    def memory_breakdown(self) -> dict[str, int]:
        """Adds the at-rest parameter shard and the peak of gathered parameters."""
        out = super().memory_breakdown()
        held = self.shard.bytes_held()
        if held:  # swap-file bytes are not memory: memory_placement() lists them
            out["parameter_shard"] = in_memory_bytes(held)
        if self.frozen is not None:
            out["frozen_parameter_shard"] = in_memory_bytes(self.frozen.bytes_held())
        out["gathered_peak"] = self.coordinator.peak_gathered_numel * self.policy.param_dtype.itemsize
        return out

    def bind(self, make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]) -> None:
        """Also, without an optimizer (an engine for evaluation and inference, a reference model),
        end each forward without gradients by releasing its units (see the coordinator)."""
        super().bind(make_optimizer)
        self.coordinator.release_after_forward = isinstance(self.optimizer, NoOptimizer)

    def detach(self) -> None:
        """Also remove the coordinator's module hooks."""
        self.coordinator.remove_hooks()
        super().detach()

    def close(self) -> None:
        """Also remove the parameter swap file, if any."""
        super().close()
        for part in (getattr(self, "shard", None), getattr(self, "frozen", None)):  # None: not made yet
            if part is not None:
                part.close()

    def memory_placement(self) -> dict[str, dict[str, int]]:
        """Adds the parameter shard's places."""
        out = super().memory_placement()
        held = self.shard.bytes_held()
        if held:
            out["parameter_shard"] = held
        if self.frozen is not None:
            out["frozen_parameter_shard"] = self.frozen.bytes_held()
        return out
