"""ZeRO-3 parameter coordinator: gather units just in time, prefetch, release.

Design note
-----------
Module forward pre-hooks gather the units of the module's direct parameters; forward post-hooks
wrap the outputs in an identity autograd function whose backward gathers the units again before
the module's own backward runs. In backward a unit is released as soon as its gradients are
complete (the gradient sync tells us); whatever is still gathered when backward returns is
released then. A forward that reads a parameter another module owns (a head tied by hand, a
regulariser over a child's weight) gathers its unit for the innermost module call in progress,
as if that module owned it (:mod:`~zeroshard.core.zero3.param_reads`).

After forward, units are *not* released at once: they stay gathered while the gathered total is
under ``stage3_max_live_parameters`` and are evicted least-recently-used beyond it. Units in use
(the modules running now, and units gathered for backward) are never evicted, nor is the most
recently used one. So a small model
stays gathered across forward and backward (no re-gather), parameters used outside their module
(a tied head in the loss) remain readable, and a large model is bounded by the budget. When the
budget holds every unit, a backward that does not end the accumulation window releases nothing:
no step can change the parameters before the next micro-step's forward, which then gathers
nothing (a window of k micro-steps gathers the model once; the window's last backward releases).

Units of frozen parameters (no gradient, never updated) stay gathered from one step to the next
while the live budget holds them, and are evicted like the others when it does not.

Gathered parameters at any moment are therefore bounded by ``stage3_max_live_parameters`` plus
the units in use, never by the model size: prefetching (up to ``stage3_prefetch_bucket_size``
elements ahead) only fills what the live budget leaves free, as in DeepSpeed.

Prefetch: every request is appended to a trace. The first pass records it; later passes follow it
and launch the all-gathers of the next units (up to ``stage3_prefetch_bucket_size`` elements ahead)
while the current module computes. A request that departs from the trace (a branch taken
differently, a module repeated or skipped, a train/eval switch) re-aligns the cursor on the next
place the trace requests that unit, so prefetching resumes after the branch; a unit the trace does
not know pauses prefetching until a known request comes. A pass that departed becomes the new
trace. Never an error: at worst the on-demand path. Prefetched units that the pass does not use
count against the live budget like any other and are evicted least-recently-used.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils import _pytree as pytree

from zeroshard.core import host_memory
from zeroshard.core.clock import StepClock
from zeroshard.core.comm import agreement
from zeroshard.core.comm import collectives as C
from zeroshard.core.comm.subset import arrive
from zeroshard.core.zero3 import late_modules, param_reads
from zeroshard.core.zero3.param_unit import ParamUnit, UnitState
from zeroshard.core.zero3.units import is_leaf, unit_modules

logger = logging.getLogger("zeroshard")

#: Bytes of released units after which freed host memory is returned to the system (CPU only).
TRIM_BYTES = 32 * 2**20


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` run eagerly inside a model compiled with ``torch.compile`` (a graph break around it, as DeepSpeed's
    ZeRO-3 hooks do): it gathers and releases units through collectives, which dynamo cannot trace."""
    disabled: Callable[..., Any] = torch.compiler.disable(hook, recursive=True)
    return disabled


class _CallInBackward(torch.autograd.Function):
    """Identity on some tensors; calls ``callback`` when their gradients arrive in backward.

    On a module's outputs, that is just before the module's backward (its units are gathered
    then); on its inputs, just after it (its units become evictable: a module called several
    times in one forward needs its parameters again for the backward of each earlier call, and its
    gradients complete only after the earliest, so without this every unit between the calls
    would stay pinned for that whole stretch of backward).
    """

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: torch.Tensor) -> Any:
        ctx.callback = callback
        # detach(), not view_as(): a view made in a custom function may not be modified in place
        # (nn.ReLU(inplace=True) on a layer's output, `h += residual`), and autograd makes this
        # function the outputs' grad_fn either way
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.callback()
        return (None, *grads)


class ParamCoordinator:
    """Owns the module hooks of a ZeRO-3 model and decides when units are gathered and released."""

    def __init__(self, module: torch.nn.Module, units: list[ParamUnit], max_live_numel: int,
                 prefetch_numel: int, *, release_after_forward: bool = False, clock: StepClock | None = None,
                 before_gather: Callable[[ParamUnit], None] | None = None) -> None:
        self.units = units
        #: called with each unit about to be gathered (the optimizer step still pending for its
        #: masters steps them first: see :mod:`zeroshard.core.offload.swapped_store`)
        self._before_gather = before_gather
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
        #: positions of each unit in ``trace``, to re-align after a departure
        self._positions: dict[ParamUnit, list[int]] = {}
        #: whether this pass departed from the trace at least once (then its recording replaces it)
        self._departed = False
        #: prefetched units in flight, with the trace position they were prefetched for
        self._ahead: dict[ParamUnit, int] = {}
        #: requests kept per pass at most (generation loops never end a pass)
        self._max_recorded = 4 * len(units) + 16
        #: units requested in this accumulation window, hashed and logged for the agreement check
        self._unit_index = {u: i for i, u in enumerate(units)}
        self.unit_names = [u.name for u in units]
        self.window_hash = 0
        self.window_log: list[int] = []
        #: this pass's forward requests, one list per module call (its backward runs them in reverse)
        self._forward_calls: list[list[ParamUnit]] = []
        #: the units of each module call in progress, innermost last: the module's own, then those
        #: of other modules' parameters its forward read (:meth:`read_outside_module`)
        self.calls: list[list[ParamUnit]] = []
        #: units a differentiable backward (``torch.autograd.grad(..., create_graph=True)``: gradient
        #: penalties) gathered: the graph it builds saves their parameters for the final backward,
        #: beyond any module's hooks, so they stay gathered until the end of the pass
        self._held_for_graph: set[ParamUnit] = set()
        self._in_backward = False
        #: this backward does not end the accumulation window and the live budget holds every unit:
        #: units stay gathered into the next micro-step's forward (the values cannot change before
        #: the step), instead of being released and gathered again
        self._hold = False
        self._sharded_numel = sum(u.numel for u in units if not u.persistent)
        self.peak_gathered_numel = 0
        self._handles: list[Any] = []
        #: an engine that never trains (no optimizer: a reference or reward model) ends the pass of
        #: each outermost forward without gradients, releasing every unit that is not persistent, as
        #: DeepSpeed does: under the live budget, which holds gathered units from pass to pass, its
        #: model stayed whole on every rank from its first forward on
        self.release_after_forward = release_after_forward
        # CPU: every TRIM_BYTES of units released in backward, return what malloc holds free (the
        # activations and autograd's buffers freed meanwhile) before the gradient shard and the
        # master rows fault in pages of their own; ZEROSHARD_MALLOC_TRIM=0 turns it off (see host_memory).
        self._trim = host_memory.TrimEvery(TRIM_BYTES if units and units[0].device.type == "cpu" else 2**62,
                                           site="release")
        self.gather_count = 0
        self.prefetch_count = 0
        self.last_used: ParamUnit | None = None
        self.step = clock  # the engine's step counter, for error messages
        self._placeholders = 0
        #: set on ranks other than 0 by a consolidated 16-bit state dict (which only rank 0 receives),
        #: until the next forward: see :meth:`after_consolidated_state_dict`
        self._lone_state_dicts = False
        self._lone_warned = False
        group = units[0].group if units else None
        mode = agreement.verify_gathers_mode()
        #: checks before each all-gather that every rank gathers the same unit (``None``: not verified)
        self._guard: agreement.GatherGuard | None = None
        if units and C.world_size(group) > 1 and mode != "off":
            self._guard = agreement.GatherGuard(group, self.unit_names, clock, every_step=mode == "all")
        self.module = module
        self._watched: list[Any] = []
        self.install_hooks()

    def install_hooks(self) -> None:
        """Attach to the module (at construction; again after :meth:`remove_hooks`, which TRL's
        generation recipe calls with every parameter gathered)."""
        if self._handles:
            return
        # Every module, not only those with parameters: :attr:`calls` must know the innermost module
        # call in progress when a forward reads another module's parameter. Before the model's own
        # pre-hooks (prepend), which may read its parameters (``weight_norm`` computes the weight
        # from two of them in one); always_call: a forward that raises must not leave its call behind.
        for m in unit_modules(self.module):
            self._handles.append(m.register_forward_pre_hook(_eager(self._pre_forward), prepend=True))
            self._handles.append(m.register_forward_hook(_eager(self._post_forward), always_call=True))
        for m in self.module_units:
            self._handles.append(m.register_state_dict_pre_hook(self._pre_state_dict))
            # torch tags the hook object itself, which a bound method does not allow.
            self._handles.append(m.register_state_dict_post_hook(functools.partial(self._post_state_dict)))
        self._watched = param_reads.watch(self.module.modules(), self, {p for u in self.units for p in u.params})
        late_modules.adopt(self.module, self)  # a trainable module attached later is refused, named

    def adopt_late(self, module: torch.nn.Module) -> None:
        """A module without trainable parameters of its own attached after set-up: its parameter dicts
        gather as the model's do (DeepSpeed's ``ZeROOrderedDict`` at the next forward); see
        :mod:`~zeroshard.core.zero3.late_modules`."""
        self._watched += param_reads.watch(module.modules(), self, None)

    # -- state dicts: full tensors, one module's units at a time --------------------------------
    @contextmanager
    def placeholders(self) -> Iterator[None]:
        """State dicts taken in this block gather nothing: partitioned parameters appear as their
        empty placeholders. For callers that need only the keys, the buffers and the parameters
        that are not partitioned (a checkpoint's layout), and may run on some ranks only."""
        self._placeholders += 1
        try:
            yield
        finally:
            self._placeholders -= 1

    def after_consolidated_state_dict(self, rank: int) -> None:
        """A consolidated 16-bit state dict was just taken on every rank: rank 0 holds it, the others
        got ``None``. accelerate's ZeRO-3 save recipe then runs ``save_pretrained(state_dict=...)`` on
        every rank, and transformers calls ``model.state_dict()`` on the ranks that got ``None``, on
        those ranks alone: there, until the next forward, state dicts gather nothing and hold the
        empty placeholders, as DeepSpeed's always do (a gather would wait for rank 0, which never comes)."""
        self._lone_state_dicts = rank != 0
        self._lone_warned = False

    def _placeholder_state_dicts(self) -> bool:
        if self._lone_state_dicts and not self._lone_warned:
            self._lone_warned = True  # info, not a warning: accelerate's recipe does this on every save
            logger.info("zeroshard: rank %d: state_dict() right after a consolidated 16-bit state dict (which "
                           "rank 0 holds) gathers nothing: its partitioned parameters are empty placeholders, as "
                           "in DeepSpeed. Gather them with GatheredParameters or engine.gathered() for values",
                           C.rank(self.units[0].group) if self.units else 0)
        return bool(self._placeholders) or self._lone_state_dicts

    def _pre_state_dict(self, module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        if not self._placeholder_state_dicts():
            self.fetch(self.module_units[module], record=False)

    def _post_state_dict(self, module: torch.nn.Module, state_dict: dict[str, Any], prefix: str,
                         local_metadata: Any) -> None:
        if self._placeholders or self._lone_state_dicts:
            return
        for name, p in module.named_parameters(recurse=False):
            if prefix + name in state_dict:
                # keep_vars=True would hand out the Parameter, empty again once released.
                state_dict[prefix + name] = p.detach()
        self.unpin(self.module_units[module])

    # -- hooks -------------------------------------------------------------------------------
    def _pre_forward(self, module: torch.nn.Module, args: Any) -> Any:
        self._lone_state_dicts = False
        # A list of this call's own: units of parameters its forward reads from other modules join it.
        units = list(self.module_units.get(module, ()))
        self.calls.append(units)
        if not units:
            return None
        self.fetch(units)
        if not torch.is_grad_enabled():
            return None
        idx = [i for i, t in enumerate(args) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:  # the first module: nothing flows back past it, its gradients end the pass
            return None
        wrapped = _CallInBackward.apply(  # type: ignore[no-untyped-call]
            functools.partial(self.module_backward_done, units), *(args[i] for i in idx))
        new_args = list(args)
        for i, t in zip(idx, wrapped):
            new_args[i] = t
        return tuple(new_args)

    def _drop_pins(self, units: Iterable[ParamUnit]) -> None:
        for u in units:
            if u in self.pinned:
                self.pinned[u] -= 1
                if not self.pinned[u]:
                    del self.pinned[u]

    def module_backward_done(self, units: list[ParamUnit]) -> None:
        """A module's backward has finished: its units are evictable again (released at once when
        all their gradients are written, see :meth:`unit_grads_done`)."""
        self._drop_pins(units)
        self._evict()

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        units = self.calls.pop() if self.calls else []
        if units:
            self._drop_pins(units)
            self._evict()
        if not torch.is_grad_enabled():
            # No backward comes to end this pass. Units still pinned now are an enclosing explicit
            # gather's (GatheredParameters around a generate()): its exit releases them.
            if self.release_after_forward and not self.calls and not self.pinned:
                self.end_of_pass(keep_frozen=False)
            return output
        if not units:
            return output
        flat, spec = pytree.tree_flatten(output)
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return output
        wrapped = _CallInBackward.apply(  # type: ignore[no-untyped-call]
            functools.partial(self.fetch, units, backward=True), *(flat[i] for i in idx))
        for i, t in zip(idx, wrapped):
            flat[i] = t
        return pytree.tree_unflatten(flat, spec)

    # -- gathering ---------------------------------------------------------------------------
    def fetch(self, units: Iterable[ParamUnit], backward: bool = False, record: bool = True) -> None:
        """Make ``units`` gathered and pinned (waiting for a prefetch if one is in flight), then
        prefetch ahead. Forward unpins in the module's post-hook; backward when the unit is released;
        an explicit gather (``record=False``, not part of the trace) with :meth:`unpin`.

        An explicit gather may be started by user code on some ranks only (``if rank == 0:
        module.state_dict()``): when it involves a partitioned unit (gathered by it, or released
        by its :meth:`unpin`, which would leave the ranks disagreeing about what is gathered and
        hang the next forward), every rank first checks in through the c10d store
        (:func:`~zeroshard.core.comm.subset.arrive`), so a missing rank is an error naming it rather
        than a hang. It does not prefetch: it is not part of the forward trace.
        """
        units = list(units)
        if backward and torch.is_grad_enabled():
            self._held_for_graph.update(u for u in units if not u.persistent)
        if not record:
            # A unit gathered and pinned by an enclosing explicit gather (GatheredParameters,
            # engine.gathered(), which every rank entered) is neither gathered nor released here.
            moved = [u for u in units if not u.persistent
                     and not (u.state is UnitState.GATHERED and self.pinned.get(u, 0) > 0)]
            if moved:
                u = next((u for u in moved if u.state is UnitState.SHARDED), moved[0])
                what = (f"{u.gather_what} (an explicit gather)" if u.state is UnitState.SHARDED
                        else f"explicit gather of ZeRO-3 unit {u.name!r}, which releases it afterwards,")
                arrive(u.group, what, None if self.step is None else self.step())
        if record:
            if not backward:  # the backward gathers what its forward did, already checked
                for u in units:
                    u.check_dtype()
            self._note_call(units, backward)
            # A persistent unit takes part in collectives only through its gradients: in a pass without
            # them (generate() without synced_gpus, ranks running different numbers of forwards) it is
            # not part of what the ranks must agree on.
            hashed = units if backward or torch.is_grad_enabled() else [u for u in units if not u.persistent]
            for u in hashed:
                i = self._unit_index[u]
                self.window_hash = agreement.extend_hash(self.window_hash, i)
                if len(self.window_log) < agreement.MAX_LOGGED:
                    self.window_log.append(i)
        for u in units:
            if record:
                self._follow_trace(u)
            elif u.quantized_values and not u.persistent and not self.pinned.get(u):
                # qwZ: what an explicit gather hands out (to read, export or change) is exact
                self.release(u)
            self._ahead.pop(u, None)
            if not u.persistent:
                self.pinned[u] = self.pinned.get(u, 0) + 1
                self.live[u] = None
                self.live.move_to_end(u)
            if u.state is UnitState.SHARDED:
                self.gather_count += 1
            if not record:
                u.reclaim()  # the caller gets tensors it may keep or change: the shard must not need them
            # Lent only for a training forward, whose backward releases (and writes back) every unit
            # soon: units an evaluation forward gathers may stay gathered until the next step.
            self._launch(u, exact=not record)
            u.wait_gather(lend=record and torch.is_grad_enabled())
            self.last_used = u
        self._note_peak()
        self._evict()
        if record:
            self._prefetch()

    @_eager
    def read_outside_module(self, u: ParamUnit) -> None:
        """A forward read a parameter of ``u``, which is not gathered: another module's (see
        :mod:`~zeroshard.core.zero3.param_reads`). Gather it for the innermost module call in progress,
        which unpins it when it ends and gathers it again before its own backward; every rank runs
        the same forward, so every rank gathers it here too."""
        if u not in self._unit_index:
            return
        self.fetch([u])
        self.calls[-1].append(u)

    def _launch(self, u: ParamUnit, exact: bool = False) -> None:
        """Start ``u``'s all-gather (nothing unless it is sharded), checking first, when gathers are
        verified, that every rank gathers the same unit; ``exact``: not quantized (qwZ)."""
        if u.state is not UnitState.SHARDED:
            return
        if self._before_gather is not None:
            self._before_gather(u)
        if self._guard is not None:
            self._guard(self._unit_index[u], u.numel, "backward" if self._in_backward else "forward", u.gather_what)
        u.launch_gather(exact=exact)

    def start_pass(self) -> None:
        """Before the engine's forward: a recording left by forwards without backward is dropped."""
        self.recording = []
        self.cursor = 0
        self.trace_valid = bool(self.trace)
        self._departed = False
        self._ahead.clear()
        self._forward_calls = []
        self.calls = []
        self._in_backward = False

    def new_window(self) -> None:
        """An optimizer step ended the accumulation window: restart the agreement record."""
        self.window_hash = 0
        self.window_log = []

    def _note_call(self, units: list[ParamUnit], backward: bool) -> None:
        """Keep this pass's forward calls; at the first backward request of a pass whose forward
        departed from the trace, predict the backward as that forward in reverse (module calls in
        reverse order), so that prefetching follows an order that changes every step."""
        if not backward:
            if not self._in_backward and len(self._forward_calls) < self._max_recorded:
                self._forward_calls.append(units)
            return
        if self._in_backward:
            return
        self._in_backward = True
        if self._departed and self._forward_calls:
            self._set_trace(self.recording + [u for call in reversed(self._forward_calls) for u in call])
            self.cursor = len(self.recording)
            self.trace_valid = True

    def _set_trace(self, trace: list[ParamUnit]) -> None:
        self.trace = trace
        self._positions = {}
        for i, u in enumerate(trace):
            self._positions.setdefault(u, []).append(i)

    def _follow_trace(self, u: ParamUnit) -> None:
        if len(self.recording) < self._max_recorded:
            self.recording.append(u)
        if self.trace_valid and self.cursor < len(self.trace) and self.trace[self.cursor] is u:
            self.cursor += 1
            return
        # A departure (a branch taken differently, a module repeated or skipped): re-align on the
        # next place the trace requests this unit, so that prefetching resumes after the branch;
        # with no such place, prefetching waits for a request the trace knows. Every rank sees the
        # same requests, so every rank makes the same choice (the all-gathers stay matched).
        self._departed = True
        later = next((i for i in self._positions.get(u, ()) if i >= self.cursor), None)
        self.trace_valid = later is not None
        if later is not None:
            self.cursor = later + 1

    def _prefetch(self) -> None:
        if not self.trace_valid or self.prefetch_numel <= 0:
            return
        # As in DeepSpeed, prefetching stays within the live budget: what is gathered ahead counts
        # against ``stage3_max_live_parameters`` too (else the default 5e7-element prefetch gathers
        # a small model whole in its first module, whatever the live budget says). Units in use
        # are outside the budget, as in :meth:`_evict`.
        in_use = sum(u.numel for u in self.pinned)
        budget = min(self.prefetch_numel, self.max_live_numel - (self._gathered_numel() - in_use))
        for i in range(self.cursor, len(self.trace)):
            u = self.trace[i]
            if u.numel > budget:
                break
            budget -= u.numel
            if u.state is UnitState.SHARDED:
                self._launch(u)
                if torch.is_grad_enabled():  # a training forward, as in fetch
                    u.lend_in_flight()
                self.prefetch_count += 1
                self.live[u] = None
                self._ahead[u] = i

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
            if u in self.pinned or u is self.last_used or self._still_ahead(u) or u in self._held_for_graph:
                continue
            over -= u.numel
            self.release(u)

    def _still_ahead(self, u: ParamUnit) -> bool:
        """A prefetch in flight that the trace still expects; one the pass departed from is
        evictable (it would otherwise stay gathered, unused, until the end of the pass)."""
        return u.state is UnitState.GATHERING and self.trace_valid and self._ahead.get(u, -1) >= self.cursor

    # -- releasing ---------------------------------------------------------------------------
    def release(self, u: ParamUnit, free_storage: bool = True) -> None:
        """Release one unit (persistent units stay gathered); see :meth:`ParamUnit.release`."""
        self.pinned.pop(u, None)
        self.live.pop(u, None)
        self._ahead.pop(u, None)
        if not u.persistent:
            was_gathered = u.state is not UnitState.SHARDED
            u.release(free_storage)
            # In backward only: there activations are being freed, while forward would hand back
            # the free heap its own activations are about to fault in again.
            if was_gathered and free_storage and self._in_backward:
                self._trim.freed(u.numel * u.dtype.itemsize)

    def unpin(self, units: Iterable[ParamUnit]) -> None:
        """End an explicit gather: unpinned units are released (persistent ones stay). Their
        tensors may still be held by the caller (a state dict): only the references go."""
        for u in units:
            if u in self.pinned:
                self.pinned[u] -= 1
                if self.pinned[u] > 0:
                    continue
            self.release(u, free_storage=False)

    def start_backward(self, boundary: bool) -> None:
        """Before a backward: whether it ends the accumulation window (see :attr:`_hold`)."""
        self._hold = not boundary and self._sharded_numel <= self.max_live_numel

    def unit_grads_done(self, u: ParamUnit) -> None:
        """Backward produced all of ``u``'s gradients: its parameters are not needed again this pass
        (unless a graph built in backward saved them, or the window goes on: :attr:`_hold`)."""
        if u in self._held_for_graph:
            return
        if self._hold:
            self.pinned.pop(u, None)
            return
        self.release(u)

    def end_of_pass(self, keep_frozen: bool = True) -> None:
        """After backward: release everything not persistent, except with ``keep_frozen`` the
        frozen units the live budget holds (their values never change: gathered again each step,
        they cost only time, 0.7 s against 0.45 s per step of a LoRA fine-tune here, at the same
        peak); adopt the recorded order as the trace."""
        self._held_for_graph.clear()
        keep: set[ParamUnit] = set()
        room = self.max_live_numel if keep_frozen else 0
        for u in reversed(self.live):  # the most recently used first
            if (u.frozen or self._hold) and u.state is UnitState.GATHERED and u.numel <= room:
                keep.add(u)
                room -= u.numel
        for u in list(self.live):
            if u not in keep:
                self.release(u)
            elif self._hold:
                u.check_unmodified()
        self.pinned.clear()
        if self.recording:
            if self._departed or self.cursor != len(self.trace):
                self._set_trace(self.recording)
            self.recording = []
        self.trace_valid = bool(self.trace)
        self._departed = False
        self._ahead.clear()
        self._forward_calls = []
        self._in_backward = False
        self._hold = False
        self.cursor = 0

    def gather_persistent(self) -> None:
        """Gather the persistent units (after set-up and after each optimizer step)."""
        for u in self.units:
            if u.persistent:
                self._launch(u)
        for u in self.units:
            if u.persistent:
                u.wait_gather()

    def remove_hooks(self) -> None:
        """Detach from the module."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        param_reads.unwatch(self._watched)
        self._watched = []
        late_modules.forget(self.module, self)
