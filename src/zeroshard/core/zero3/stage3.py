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
(:mod:`~zeroshard.core.zero3.frozen`), gathered and released by the same coordinator.

Memory residency per rank (Ψ parameters, N ranks, 16-bit compute, Adam, gradients accumulated in
the compute dtype): parameter shard 2Ψ/N + gradient shard 2Ψ/N + master 4Ψ/N + Adam 8Ψ/N = 16Ψ/N,
plus the gathered units (bounded by ``stage3_max_live_parameters`` and the units in use) and the
persistent small units. With fp32 compute the parameter shard *is* the master shard, and in host
memory a gathered unit's row of it is handed back to the system while the unit holds a copy
(:mod:`~zeroshard.core.zero3.lent_rows`): the rank then holds its chunk once, not twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.core import host_memory
from zeroshard.core.offload import OffloadPolicy
from zeroshard.core.offload.param_store import ParamShard
from zeroshard.core.offload.policy import Residency
from zeroshard.core.offload.state_store import SubGroup
from zeroshard.core.precision import LossScaler, PrecisionPolicy
from zeroshard.core.seam import the_unit
from zeroshard.core.zero3.coordinator import ParamCoordinator
from zeroshard.core.zero3.frozen import FrozenShard
from zeroshard.core.zero3.lent_rows import RowLender
from zeroshard.core.zero3.param_unit import ParamUnit
from zeroshard.core.zero3.parameter_offload import ParameterOffload
from zeroshard.core.zero3.secondary import SecondaryShards
from zeroshard.core.zero_optimizer import StageParts, StageSpec, ZeroOptimizer, in_memory_bytes

logger = logging.getLogger("zeroshard")


@dataclass(frozen=True)
class Zero3Parts:
    """What stage 3 adds to a stage's parts, built by :func:`zeroshard.core.build.build_stage`."""

    #: the compute-dtype parameter shard, where the offload policy puts it (device, host or a file)
    shard: ParamShard
    #: one unit per bucket of trained parameters
    units: list[ParamUnit]
    #: the frozen parameters' chunks and units (``None`` when every parameter trains)
    frozen: FrozenShard | None
    #: lends master rows to gathered units (fp32 in host memory), or ``None``
    lender: RowLender | None
    coordinator: ParamCoordinator
    #: counts each unit's gradients in a backward (the gradient sync reports each parameter to it)
    grads: UnitGradCounter
    #: ZeRO++ hpZ: the group of each unit's secondary shard (``None`` without hpZ)
    secondaries: SecondaryShards | None = None


class UnitGradCounter:
    """Counts the gradients each unit still waits for in a backward; once a unit has all of them,
    no parameter of it is needed again this pass, and the coordinator may release it."""

    def __init__(self, units: list[ParamUnit], coordinator: ParamCoordinator) -> None:
        self._unit_of = {p: u for u in units for p in u.params}
        self._units = units
        self._coordinator = coordinator
        self._missing: dict[ParamUnit, int] = {}

    def start(self) -> None:
        """A backward begins: every unit waits for all its parameters' gradients."""
        self._missing = {u: len(u.params) for u in self._units}

    def param_done(self, p: torch.nn.Parameter) -> None:
        """``p``'s gradient has been written (called by the gradient sync)."""
        u = self._unit_of[p]
        self._missing[u] = self._missing.get(u, len(u.params)) - 1
        if self._missing[u] == 0:
            self._coordinator.unit_grads_done(u)

    def trained(self) -> set[torch.nn.Parameter]:
        """The parameters of the trained units."""
        return set(self._unit_of)


class Stage3Optimizer(ZeroOptimizer):
    """The optimizer ``initialize`` returns for ZeRO stage 3; it also owns the parameter units."""

    def __init__(self, module: torch.nn.Module, param_groups: list[dict[str, Any]], spec: StageSpec,
                 policy: PrecisionPolicy, scaler: LossScaler, group: dist.ProcessGroup | None,
                 device: torch.device, offload: OffloadPolicy, parts: StageParts, zero3: Zero3Parts) -> None:
        super().__init__(param_groups, spec, policy, scaler, group, device, offload, parts)
        self.module = module
        self.shard = zero3.shard
        self.units = zero3.units
        self.frozen = zero3.frozen
        self.lender = zero3.lender
        self.coordinator: ParamCoordinator = zero3.coordinator
        self._grads = zero3.grads
        #: ZeRO++ hpZ's group and the bytes its secondary shards hold (``None`` without hpZ)
        self.secondaries = zero3.secondaries
        #: DeepSpeed's name for the owner of the module hooks (TRL removes and re-adds them)
        self.parameter_offload = ParameterOffload(self.coordinator, module)

    def grad_shard(self) -> list[torch.Tensor]:
        self.sync.shard_grads()  # zeroes what no backward reduced in this window
        # The reduction buckets span several units; the shard accumulator is in layout order.
        acc = self.sync.accumulator()  # type: ignore[attr-defined]
        return [acc[b.start : b.start + b.numel] for b in self.buckets]

    def start_backward(self, boundary: bool) -> None:
        """Count the gradients each unit still waits for in this backward (after the last step's
        sub-groups the forward did not need: its gradients are read until then)."""
        self.store.finish_step()
        super().start_backward(boundary)
        self.coordinator.start_backward(boundary)
        self._grads.start()

    def _backward_reads_parameter_files(self) -> bool:
        """Only a unit released since its forward is read again: when every unit is still gathered
        (a live budget that holds the model, DeepSpeed's default for models under 1e9 parameters),
        backward leaves the disk to the optimizer state read ahead for the step."""
        if self.offload.params is not Residency.FILE:
            return False
        return any(not u.persistent and u not in self.coordinator.live for u in self.coordinator.units)

    def finish_backward(self) -> None:
        """Complete the gradient collectives, then release every non-persistent unit."""
        self.sync.finish_backward()
        self.coordinator.end_of_pass()
        self._drop_secondaries()
        host_memory.trim(self.device, site="step")

    def _drop_secondaries(self) -> None:
        """hpZ's secondary shards serve one pass: the step changes what they copy."""
        for u in self.units:
            u.drop_secondary()

    def _step_store(self, g32: list[torch.Tensor], skip: set[torch.nn.Parameter],
                    stepped: Callable[[SubGroup], None] | None, prepare: Callable[[SubGroup], None] | None) -> None:
        """Begin the step only: with swapped optimizer state its sub-groups are stepped as the next
        forward gathers their units (their reads and writes overlap it), and whatever reads or writes
        the state first finishes it (``SwappedStateStore.begin_step``); in memory, the whole step."""
        self.store.begin_step(g32, skip=skip, stepped=stepped, prepare=prepare)

    def _begin_publish(self) -> None:
        """Nothing to gather: the store publishes each stepped sub-group into the parameter shard."""
        return None

    def publish(self) -> None:
        """Refresh the 16-bit shard from the masters and drop stale gathered copies."""
        self._drop_secondaries()
        self.store.refresh()  # a no-op right after a step: it published each sub-group as it went
        self.shard.flush()  # parameter swap-file writes in flight end here, their errors with them
        with torch.no_grad():
            # Anything still gathered (eval forwards, persistent units) is stale now.
            # Frozen units change only when a checkpoint is loaded into them.
            for u in self.units + (self.frozen.stale_units() if self.frozen is not None else []):
                self.coordinator.live.pop(u, None)
                # Persistent units are visible between steps: user code may hold their tensors.
                u.release(free_storage=not u.persistent)
            if self.store.step_pending:
                return  # gathered by the next forward, once their sub-groups are stepped, as the others
            self.coordinator.gather_persistent()

    def write_back(self, p: torch.nn.Parameter) -> None:
        """Write the gathered value of ``p`` into this rank's master and parameter shards (a frozen
        parameter: into its chunk)."""
        if self.frozen is not None and p in self.frozen.ranges:
            s, e = self.frozen.ranges[p]
            self.frozen.write(p, p.detach().reshape(-1)[s:e])
            return
        super().write_back(p)
        unit: ParamUnit = the_unit(p)
        i = unit.position(p)
        s, e = self.master.ranges[p]
        off = unit.bucket.offsets[i]
        with torch.no_grad():
            unit.write_shard(off, p.detach().reshape(-1)[s:e])

    def gather_context(self, params: list[torch.nn.Parameter]) -> tuple[Callable[[], None], Callable[[], None]]:
        """``(enter, exit)``: gather and pin the units of ``params``; unpin and release on exit."""
        units = list(dict.fromkeys(the_unit(p) for p in params))
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
        if self.secondaries is not None:  # hpZ: the secondary shards' peak over a pass
            out["secondary_shard_peak"] = self.secondaries.peak_bytes
        return out

    def detach(self) -> None:
        """Also remove the coordinator's module hooks."""
        self.coordinator.remove_hooks()
        super().detach()

    def close(self) -> None:
        """Also remove the parameter swap file, if any."""
        super().close()
        self.shard.close()
        if self.frozen is not None:
            self.frozen.close()

    def memory_placement(self) -> dict[str, dict[str, int]]:
        """Adds the parameter shard's places."""
        out = super().memory_placement()
        held = self.shard.bytes_held()
        if held:
            out["parameter_shard"] = held
        if self.frozen is not None:
            out["frozen_parameter_shard"] = self.frozen.bytes_held()
        return out
