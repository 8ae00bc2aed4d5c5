"""ZeRO-3 parameter coordinator: gather units just in time, prefetch, release.

Design note
-----------
Module forward pre-hooks gather the units of the module's direct parameters; forward post-hooks
wrap the outputs in an identity autograd function whose backward gathers the units again before
the module's own backward runs. In backward a unit is released as soon as its gradients are
complete (the gradient sync tells us); whatever is still gathered when backward returns is
released then.

After forward, units are *not* released at once: they stay gathered while the gathered total is
under ``stage3_max_live_parameters`` and are evicted least-recently-used beyond it. Units in use
(the modules running now, and units gathered for backward) are never evicted, nor is the most
recently used one. So a small model
stays gathered across forward and backward (no re-gather), parameters used outside their module
(a tied head in the loss) remain readable, and a large model is bounded by the budget.

Gathered parameters at any moment are therefore bounded by ``stage3_max_live_parameters`` plus
the units in use plus ``stage3_prefetch_bucket_size``, never by the model size.

Prefetch: every request is appended to a trace. The first pass records it; later passes follow it
and launch the all-gathers of the next units (up to ``stage3_prefetch_bucket_size`` elements ahead)
while the current module computes. A request that departs from the trace (train/eval switch, a
branch not taken) turns prefetching off for the rest of the pass and starts a new recording:
never an error, only the on-demand path until the order is known again.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from zeroshard.stages.param_unit import ParamUnit, UnitState
from zeroshard.stages.units import is_leaf, unit_modules


class _PreBackward(torch.autograd.Function):
    """Identity in forward; in backward, gathers a module's units before its gradients are computed."""

    @staticmethod
    def forward(ctx: Any, coordinator: ParamCoordinator, units: list[ParamUnit], *tensors: torch.Tensor) -> Any:
        ctx.coordinator = coordinator
        ctx.units = units
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.coordinator.fetch(ctx.units, backward=True)
        return (None, None, *grads)


class ParamCoordinator:
    """Owns the module hooks of a ZeRO-3 model and decides when units are gathered and released."""

    def __init__(self, module: torch.nn.Module, units: list[ParamUnit], max_live_numel: int,
                 prefetch_numel: int) -> None:
        self.units = units
        self.max_live_numel = max_live_numel
        self.prefetch_numel = prefetch_numel
        by_param = {p: u for u in units for p in u.params}
        self.module_units: dict[torch.nn.Module, list[ParamUnit]] = {}
        for m in unit_modules(module):
            mine = list(dict.fromkeys(by_param[p] for p in m.parameters(recurse=is_leaf(m)) if p in by_param))
            if mine:
                self.module_units[m] = mine
        self.live: OrderedDict[ParamUnit, None] = OrderedDict()
        self.pinned: dict[ParamUnit, int] = {}
        self.trace: list[ParamUnit] = []
        self.recording: list[ParamUnit] = []
        self.cursor = 0
        self.trace_valid = False
        self.peak_gathered_numel = 0
        self._handles: list[Any] = []
        self.gather_count = 0
        self.prefetch_count = 0
        self.last_used: ParamUnit | None = None
        for m in self.module_units:
            self._handles.append(m.register_forward_pre_hook(self._pre_forward))
            self._handles.append(m.register_forward_hook(self._post_forward))
            self._handles.append(m.register_state_dict_pre_hook(self._pre_state_dict))
            # torch tags the hook object itself, which a bound method does not allow.
            self._handles.append(m.register_state_dict_post_hook(functools.partial(self._post_state_dict)))

    # -- state dicts: full tensors, one module's units at a time --------------------------------
    def _pre_state_dict(self, module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        self.fetch(self.module_units[module], record=False)

    def _post_state_dict(self, module: torch.nn.Module, state_dict: dict[str, Any], prefix: str,
                         local_metadata: Any) -> None:
        for name, p in module.named_parameters(recurse=False):
            if prefix + name in state_dict:
                # keep_vars=True would hand out the Parameter, empty again once released.
                state_dict[prefix + name] = p.detach()
        self.unpin(self.module_units[module])

    # -- hooks -------------------------------------------------------------------------------
    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        self.fetch(self.module_units[module])

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        units = self.module_units[module]
        for u in units:
            if u in self.pinned:
                self.pinned[u] -= 1
                if not self.pinned[u]:
                    del self.pinned[u]
        self._evict()
        if not torch.is_grad_enabled():
            return output
        flat, spec = pytree.tree_flatten(output)
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return output
        wrapped = _PreBackward.apply(self, units, *(flat[i] for i in idx))
        for i, t in zip(idx, wrapped):
            flat[i] = t
        return pytree.tree_unflatten(flat, spec)

    # -- gathering ---------------------------------------------------------------------------
    def fetch(self, units: Iterable[ParamUnit], backward: bool = False, record: bool = True) -> None:
        """Make ``units`` gathered and pinned (waiting for a prefetch if one is in flight), then
        prefetch ahead. Forward unpins in the module's post-hook; backward when the unit is released;
        an explicit gather (``record=False``, not part of the trace) with :meth:`unpin`."""
        for u in units:
            if record:
                self._follow_trace(u)
            if not u.persistent:
                self.pinned[u] = self.pinned.get(u, 0) + 1
                self.live[u] = None
                self.live.move_to_end(u)
            if u.state is UnitState.SHARDED:
                self.gather_count += 1
            u.wait_gather()
            self.last_used = u
        self._note_peak()
        self._evict()
        self._prefetch()

    def start_pass(self) -> None:
        """Before the engine's forward: a recording left by forwards without backward is dropped."""
        self.recording = []
        self.cursor = 0
        self.trace_valid = bool(self.trace)

    def _follow_trace(self, u: ParamUnit) -> None:
        if len(self.recording) < 4 * len(self.units) + 16:  # generation loops never end a pass
            self.recording.append(u)
        if self.trace_valid and self.cursor < len(self.trace) and self.trace[self.cursor] is u:
            self.cursor += 1
        else:
            self.trace_valid = False

    def _prefetch(self) -> None:
        if not self.trace_valid or self.prefetch_numel <= 0:
            return
        budget = self.prefetch_numel
        for u in self.trace[self.cursor :]:
            if u.numel > budget:
                break
            budget -= u.numel
            if u.state is UnitState.SHARDED:
                u.launch_gather()
                self.prefetch_count += 1
                self.live[u] = None

    def _gathered_numel(self) -> int:
        return sum(u.numel for u in self.live)

    def _note_peak(self) -> None:
        self.peak_gathered_numel = max(self.peak_gathered_numel, self._gathered_numel())

    def _evict(self) -> None:
        over = self._gathered_numel() - self.max_live_numel
        # The most recently used unit always stays: after forward that is the last module (an LM
        # head), whose weight losses and tied layers read outside any module's forward.
        for u in list(self.live):
            if over <= 0:
                break
            if u in self.pinned or u is self.last_used or u.state is UnitState.GATHERING:
                continue
            over -= u.numel
            self.release(u)

    # -- releasing ---------------------------------------------------------------------------
    def release(self, u: ParamUnit) -> None:
        """Release one unit (persistent units stay gathered)."""
        self.pinned.pop(u, None)
        self.live.pop(u, None)
        if not u.persistent:
            u.release()

    def unpin(self, units: Iterable[ParamUnit]) -> None:
        """End an explicit gather: unpinned units are released (persistent ones stay)."""
        for u in units:
            if u in self.pinned:
                self.pinned[u] -= 1
                if self.pinned[u] > 0:
                    continue
            self.release(u)

    def unit_grads_done(self, u: ParamUnit) -> None:
        """Backward produced all of ``u``'s gradients: its parameters are not needed again this pass."""
        self.release(u)

    def end_of_pass(self) -> None:
        """After backward: release everything not persistent, adopt the recorded order as the trace."""
        for u in list(self.live):
            self.release(u)
        self.pinned.clear()
        if self.recording:
            if not (self.trace_valid and self.cursor == len(self.trace)):
                self.trace = self.recording
            self.recording = []
        self.trace_valid = bool(self.trace)
        self.cursor = 0

    def gather_persistent(self) -> None:
        """Gather the persistent units (after set-up and after each optimizer step)."""
        for u in self.units:
            if u.persistent:
                u.launch_gather()
        for u in self.units:
            if u.persistent:
                u.wait_gather()

    def remove_hooks(self) -> None:
        """Detach from the module."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
