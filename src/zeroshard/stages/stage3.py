"""ZeRO stage 3: stage 2 plus parameters partitioned at rest and gathered per unit.

Design note
-----------
Units are modules' direct parameters (a parameter shared by several modules belongs to the
first), or a whole subtree for modules marked with ``set_z3_leaf_modules``. Each unit is one
bucket of the usual per-parameter chunk layout, so the fp32 master
shard, the gradient shard and the compute-dtype parameter shard are three flat buffers with the
same geometry: after the optimizer step the new parameter shard is a cast of the master shard, no
collective needed. Forward and backward gather units through :class:`ParamCoordinator`; gradients
are reduce-scattered unit by unit as soon as a unit's gradients are complete, and the unit is
released at that moment.

Memory residency per rank (Ψ parameters, N ranks, 16-bit compute, Adam, gradients accumulated in
the compute dtype): parameter shard 2Ψ/N + gradient shard 2Ψ/N + master 4Ψ/N + Adam 8Ψ/N = 16Ψ/N,
plus the gathered units (bounded by ``stage3_max_live_parameters`` and the units in use) and the
persistent small units. With fp32 compute the parameter shard *is* the master shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.partition import INIT_CHUNK_ATTR, SHAPE_ATTR, Bucket, buckets_from_groups
from zeroshard.precision import LossScaler, PrecisionPolicy
from zeroshard.stages.coordinator import ParamCoordinator
from zeroshard.stages.param_unit import ParamUnit, UnitState
from zeroshard.stages.units import is_leaf, unit_modules
from zeroshard.stages.zero_optimizer import StageSpec, ZeroOptimizer


class Stage3Optimizer(ZeroOptimizer):
    """The optimizer ``initialize`` returns for ZeRO stage 3; it also owns the parameter units."""

    def __init__(self, module: torch.nn.Module, param_groups: list[dict[str, Any]], spec: StageSpec,
                 policy: PrecisionPolicy, scaler: LossScaler, group: dist.ProcessGroup | None,
                 device: torch.device) -> None:
        self.module = module
        super().__init__(param_groups, spec, policy, scaler, group, device)
        dtype = policy.param_dtype
        self.param_shard = self.master.flat if dtype == torch.float32 else self.master.flat.to(dtype)
        names = {p: n for n, p in module.named_parameters()}
        self.units = [
            ParamUnit(b, self.param_shard[b.start : b.start + b.numel], group,
                      persistent=sum(lay.numel for lay in b.layouts) <= spec.param_persistence_threshold,
                      name=names.get(b.params[0], "?"))
            for b in self.buckets
        ]
        for u in self.units:
            for p, shape in zip(u.params, u.shapes):
                p._zeroshard_unit = u  # type: ignore[attr-defined]
                setattr(p, SHAPE_ATTR, shape)
                if hasattr(p, INIT_CHUNK_ATTR):
                    delattr(p, INIT_CHUNK_ATTR)  # adopted into the shard buffers
            u.state = UnitState.GATHERED  # the module may still hold full values: release them now
            u.release()
        self.coordinator = ParamCoordinator(module, self.units, spec.max_live_parameters,
                                            spec.prefetch_bucket_size)
        self.coordinator.gather_persistent()
        self._unit_of_bucket = {u.bucket.index: u for u in self.units}
        self.sync.ordered = False
        self.sync.on_complete = self._bucket_done

    def _make_buckets(self, params: list[torch.nn.Parameter]) -> list[Bucket]:
        trained = set(params)
        groups: list[list[torch.nn.Parameter]] = []
        seen: set[torch.nn.Parameter] = set()
        for m in unit_modules(self.module):
            mine = [p for p in m.parameters(recurse=is_leaf(m)) if p in trained and p not in seen]
            seen.update(mine)
            if mine:
                groups.append(mine)
        return buckets_from_groups(groups, self.world)

    def _bucket_done(self, bucket: Bucket) -> None:
        self.coordinator.unit_grads_done(self._unit_of_bucket[bucket.index])

    def finish_backward(self) -> None:
        """Complete the gradient collectives, then release every non-persistent unit."""
        super().finish_backward()
        self.coordinator.end_of_pass()

    def publish(self) -> None:
        """Refresh the 16-bit shard from the masters and drop stale gathered copies."""
        with torch.no_grad():
            if self.param_shard is not self.master.flat:
                self.param_shard.copy_(self.master.flat)
            # Anything still gathered (eval forwards, persistent units) is stale now.
            for u in self.units:
                self.coordinator.live.pop(u, None)
                u.release()
            self.coordinator.gather_persistent()

    def write_back(self, p: torch.nn.Parameter) -> None:
        """Write the gathered value of ``p`` into this rank's master and parameter shards."""
        super().write_back(p)
        unit: ParamUnit = p._zeroshard_unit  # type: ignore[attr-defined]
        i = unit.params.index(p)
        s, e = self.master.ranges[p]
        off = unit.bucket.offsets[i]
        with torch.no_grad():
            unit.shard[off : off + (e - s)].copy_(p.detach().reshape(-1)[s:e])

    def gather_context(self, params: list[torch.nn.Parameter]) -> tuple[Callable[[], None], Callable[[], None]]:
        """``(enter, exit)``: gather and pin the units of ``params``; unpin and release on exit."""
        units = list(dict.fromkeys(p._zeroshard_unit for p in params))  # type: ignore[attr-defined]
        return (lambda: self.coordinator.fetch(units, record=False)), (lambda: self.coordinator.unpin(units))

    def memory_breakdown(self) -> dict[str, int]:
        """Adds the at-rest parameter shard and the peak of gathered parameters."""
        out = super().memory_breakdown()
        elem = self.param_shard.element_size()
        if self.param_shard is not self.master.flat:
            out["parameter_shard"] = self.param_shard.numel() * elem
        out["gathered_peak"] = self.coordinator.peak_gathered_numel * elem
        return out
