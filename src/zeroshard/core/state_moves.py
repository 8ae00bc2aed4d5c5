"""Moving a stage's training state to host memory and back, between training phases.

What ``engine.offload_states()`` / ``engine.reload_states()`` do (DeepSpeed's names and refusals
are in :mod:`zeroshard.deepspeed.offload_states`): an RLHF loop frees the accelerator of the
optimizer state, the master weights, the parameters or the gradients of the engine it trains while
it generates with another, then brings them back, bit for bit, before the next step.

Design note
-----------
A stage's state is a few flat buffers and many views of them, held in many places: the master
views the torch optimizer steps (keys of its state, members of its param groups and of the state
store's sub-groups) view the flat master buffer, or in fp32 at stages 1-2 the module's parameters
themselves; ZeRO-3 units gather from views of the parameter shard, which without offload *is* the
master buffer; DeepSpeed's ``p.ds_tensor`` is one more view; the gradient sync keeps views of its
accumulator. Moving tensors one by one would split such aliases (and keep the old memory alive
through the views left behind). So the move is made per *storage*: each storage is copied byte for
byte into a new one where it goes, and every tensor the stage holds on it, whichever kind names it,
is re-pointed at the same offset, sizes and strides of the copy (``tensor.data = ...``: the tensor
objects, and whoever holds them, stay). Aliases stay aliases, values are bit-identical, and once no
tensor points at the old storage its memory goes back to the allocator. Views handed out of the
core (``ds_tensor``) are handed out again through the stage's :class:`~zeroshard.core.seam.ParamObserver`.

Only storages on the training device move: state the config already keeps in host memory (CPU
optimizer offload, page-locked gradient shards) and torch's CPU ``step`` counters stay where they
are. On the CPU the training device is the host, so every named storage is copied into a new host
storage and back: a no-op in memory terms, through the same code as on an accelerator (the tests
run it, and check that every old storage is freed, i.e. that no alias was left behind).

What each :class:`StateKind` names:

- ``OPTIMIZER_STATES``: every tensor of the torch optimizer's per-parameter state (none with NVMe
  optimizer offload: it lives in swap files).
- ``MASTER_WEIGHTS``: the fp32 master buffer (with partial optimizer offload, its two parts) and
  its per-parameter views (none when swapped to NVMe). In fp32 at stages 1-2 the masters are views
  of the parameters, and at stage 3 without offload the parameter shard is the master buffer:
  moving either moves both.
- ``PARAMETERS``: stages 1-2: the trained parameters (the module's full compute-dtype tensors) and,
  with masters in swap files, the compute-dtype shard the all-gathers pack from; stage 3: the
  parameter shard (when in memory) and the frozen parameters' chunks. Units gathered for use are
  released first (DeepSpeed's ``empty_partition_cache()``); persistent units stay gathered.
- ``GRADIENTS``: stage 1: the full-size accumulator; stages 2-3: this rank's gradient shard while
  it exists (from a window's first reduction to its step; freed after the step).
- ``GRAD_BUFFERS``: the reduce buckets. They exist during backward only (freed at its end), so
  there is nothing to move.

While states are in host memory a ZeRO-3 forward still works (units are gathered from the shard
wherever it is, as with parameter offload); whether anything else may run is for the caller
(:mod:`zeroshard.deepspeed.offload_states` refuses the step).
"""

from __future__ import annotations

import enum
import gc
from collections.abc import Callable, Iterable, Sequence

import torch

from zeroshard.core import host_memory
from zeroshard.core.grad_sync import GradSync
from zeroshard.core.offload.policy import Residency, host_device, host_empty, place_of, should_pin
from zeroshard.core.zero3.param_unit import ParamUnit
from zeroshard.core.zero3.stage3 import Stage3Optimizer
from zeroshard.core.zero_optimizer import ZeroOptimizer

__all__ = ["StateKind", "StateMover", "relocate"]

#: ``(device, data pointer)`` of a storage
_Key = tuple[torch.device, int]
#: allocates a byte buffer of ``nbytes`` on a device (for one storage being moved)
Allocate = Callable[[int], torch.Tensor]


class StateKind(enum.Enum):
    """A kind of training state a rank holds (see the module's docstring for what each names)."""

    OPTIMIZER_STATES = "optimizer_states"
    MASTER_WEIGHTS = "master_weights"
    PARAMETERS = "parameters"
    GRADIENTS = "gradients"
    GRAD_BUFFERS = "grad_buffers"


def _key(t: torch.Tensor) -> _Key:
    return t.device, t.untyped_storage().data_ptr()


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _distinct(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` without repeats of the same tensor object (by identity, not value)."""
    return list({id(t): t for t in tensors}.values())


def relocate(tensors: Sequence[torch.Tensor], device: torch.device, *, pin: bool = False,
             non_blocking: bool = False, allocate: Callable[[torch.Tensor], Allocate | None] | None = None,
             ) -> dict[_Key, _Key]:
    """Move the storages of ``tensors`` to ``device``: one byte-for-byte copy per storage, and each
    tensor re-pointed at the same offset, sizes and strides of its storage's copy (so tensors that
    aliased each other still do; every tensor on a storage must be among ``tensors``, or it keeps
    the old storage alive and stops aliasing the others). Storages with no bytes stay.

    Args:
        device: where the copies go (host memory when ``device`` is the CPU).
        pin: page-locked host memory (only where :func:`~zeroshard.core.offload.policy.should_pin` holds).
        non_blocking: the copies may run asynchronously, overlapping each other; they are complete
            on return (the old storages are released only then).
        allocate: for a storage (given one tensor on it), its own allocation of ``nbytes`` bytes, or
            ``None`` for the default one (``host_memory.empty`` in host memory, ``torch.empty`` on a device).

    Returns:
        ``{old storage key: new storage key}`` for each storage moved.
    """
    groups: dict[_Key, list[torch.Tensor]] = {}
    for t in _distinct(tensors):
        if _nbytes(t) > 0:
            groups.setdefault(_key(t), []).append(t)
    moved: dict[_Key, _Key] = {}
    #: the old storages, alive until asynchronous copies out of them are complete
    sources: list[torch.Tensor] = []
    with torch.no_grad():
        for key, ts in groups.items():
            storage = ts[0].untyped_storage()
            nbytes = storage.nbytes()
            own = allocate(ts[0]) if allocate is not None else None
            if own is not None:
                dst = own(nbytes)
            elif device.type == "cpu":
                dst = host_empty(nbytes, torch.uint8, True) if pin else host_memory.empty(nbytes, torch.uint8, device)
            else:
                dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
            src = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            dst[:nbytes].copy_(src, non_blocking=non_blocking)
            if non_blocking:
                sources.append(src)
            new = dst.untyped_storage()
            for t in ts:
                t.data = torch.empty(0, dtype=t.dtype, device=device).set_(new, t.storage_offset(), t.size(),
                                                                             t.stride())
            moved[key] = _key(ts[0])
    if sources and torch.cuda.is_available() and any(t.device.type == "cuda" for t in (*sources, *tensors)):
        torch.cuda.synchronize()
    return moved


class StateMover:
    """Moves kinds of a stage's state (stages 1-3) to host memory and back to the training device.

    One per stage; :attr:`offloaded` says which kinds are away. A kind already away is not moved
    again; :meth:`reload` brings back everything that was moved.
    """

    def __init__(self, stage: ZeroOptimizer) -> None:
        if stage.spec.stage == 0:
            raise ValueError("moving training state to host memory needs ZeRO stage 1, 2 or 3")
        self.stage = stage
        self.device = stage.device
        #: the kinds moved to host memory (or asked to be, with nothing on the device to move)
        self._offloaded: set[StateKind] = set()
        #: the host storages made by :meth:`offload` (the key of each)
        self._moved: set[_Key] = set()
        #: bytes the last :meth:`offload` or :meth:`reload` copied
        self.moved_bytes = 0
        #: the masters live in a mapping of their own whose pages ZeRO-3 lends (fp32 on the CPU):
        #: every copy of them gets a mapping too, so that lending keeps handing memory back
        self._masters_mapped = stage.master.droppable

    @property
    def offloaded(self) -> frozenset[StateKind]:
        """The kinds in host memory now."""
        return frozenset(self._offloaded)

    # -- what each kind holds -------------------------------------------------------------------
    def tensors(self, kind: StateKind) -> list[torch.Tensor]:
        """Every tensor the stage holds of ``kind`` in memory (views included), wherever it is."""
        s = self.stage
        m = s.master
        units = self._units()
        if kind is StateKind.OPTIMIZER_STATES:
            if s.optimizer is None or s.plan.masters is Residency.FILE:
                return []
            return [v for st in s.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        if kind is StateKind.MASTER_WEIGHTS:
            if m.swapped:
                return []
            out = [*m.segments, *m.views.values()]  # two buffers with partial optimizer offload
            if isinstance(s, Stage3Optimizer) and s.shard.aliased:
                out += [u.shard for u in units if u.shard is not None]
            return out
        if kind is StateKind.PARAMETERS:
            if not isinstance(s, Stage3Optimizer):
                return [*m.views, *([m.pack_source] if m.compute_copy else [])]
            frozen = s.frozen.units if s.frozen is not None else []
            shard = [s.shard.flat] if s.shard.flat is not None else []
            return [*shard, *(u.shard for u in units + frozen if u.shard is not None)]
        if kind is StateKind.GRADIENTS:
            return _gradient_tensors(s.sync)
        return []  # GRAD_BUFFERS: freed at the end of every backward

    def devices(self, kind: StateKind) -> set[torch.device]:
        """Where ``kind`` is (empty: nothing of it in memory). Optimizer states: the per-element
        ones (torch keeps its scalar ``step`` counters on the CPU wherever the state is)."""
        ts = self.tensors(kind)
        if kind is StateKind.OPTIMIZER_STATES:
            ts = [t for t in ts if t.dim() > 0]
        return {t.device for t in ts if t.numel() > 0}

    def bytes_on_device(self, kinds: Iterable[StateKind]) -> int:
        """Bytes of the distinct storages of ``kinds`` on the training device: what :meth:`offload`
        of them would free there (aliased kinds included, see :meth:`offload`)."""
        return _bytes_of(self._storages(set(kinds), movable=self._on_device))

    # -- moving ---------------------------------------------------------------------------------
    def offload(self, kinds: Iterable[StateKind], *, pin: bool = True, non_blocking: bool = False) -> int:
        """Move ``kinds`` to host memory (page-locked when ``pin`` and an accelerator is present);
        with them, any other kind sharing their storages (fp32 masters at stages 1-2 are the
        parameters; stage 3's shard is the masters), which is then offloaded too. Returns the bytes
        copied; the copies are complete on return (``non_blocking`` lets them overlap each other)."""
        wanted = set(kinds)
        self._prepare()
        groups = self._storages(wanted, movable=self._on_device)
        pinned = should_pin(pin, self.device)
        moved = set(relocate([t for ts in groups.values() for t in ts], host_device(), pin=pinned,
                             non_blocking=non_blocking, allocate=self._allocator(host_device(), pinned)).values())
        self._moved |= moved
        self._offloaded |= wanted | {k for k in StateKind if any(_key(t) in moved for t in self.tensors(k))}
        self.moved_bytes = _bytes_of(groups)
        self._after_move(groups, collect=True)
        return self.moved_bytes

    def reload(self, *, non_blocking: bool = False) -> int:
        """Bring back everything :meth:`offload` moved, to the training device. Returns the bytes copied."""
        if not self._moved and not self._offloaded:
            self.moved_bytes = 0
            return 0
        self._prepare()
        groups = self._storages(set(StateKind), movable=lambda t: _key(t) in self._moved)
        relocate([t for ts in groups.values() for t in ts], self.device, non_blocking=non_blocking,
                 allocate=self._allocator(self.device, False))
        self._moved.clear()
        self._offloaded.clear()
        self.moved_bytes = _bytes_of(groups)
        self._after_move(groups)
        return self.moved_bytes

    def placement(self, out: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
        """``memory_placement()`` while states are offloaded: the places of what moved where the
        stage's own report says where the config put it (gradients; stages 1-2's parameters)."""
        s = self.stage
        if StateKind.GRADIENTS in self._offloaded:
            grads = _gradient_tensors(s.sync)
            if grads:
                out["gradients"] = {place_of(grads[0]): s.sync.bytes_held()}
        if StateKind.PARAMETERS in self._offloaded and not isinstance(s, Stage3Optimizer):
            places: dict[str, int] = {}
            for p in s.master.views:
                places[place_of(p)] = places.get(place_of(p), 0) + p.numel() * p.element_size()
            out["parameters"] = places
        return out

    # -- helpers -------------------------------------------------------------------------------
    def _units(self) -> list[ParamUnit]:
        return self.stage.units if isinstance(self.stage, Stage3Optimizer) else []

    def _on_device(self, t: torch.Tensor) -> bool:
        return _same_device(t.device, self.device) and _key(t) not in self._moved

    def _storages(self, kinds: set[StateKind], movable: Callable[[torch.Tensor], bool],
                  ) -> dict[_Key, list[torch.Tensor]]:
        """The storages of ``kinds`` that ``movable`` accepts, each with every tensor of any kind on
        it (moved together, so that aliases across kinds stay aliases)."""
        wanted = {_key(t) for k in kinds for t in self.tensors(k) if _nbytes(t) > 0 and movable(t)}
        groups: dict[_Key, list[torch.Tensor]] = {}
        for t in _distinct(t for k in StateKind for t in self.tensors(k)):
            if _nbytes(t) > 0 and _key(t) in wanted:
                groups.setdefault(_key(t), []).append(t)
        return groups

    def _prepare(self) -> None:
        """Nothing may hold state outside the tensors :meth:`tensors` lists: stages 1-2 fold in
        parameters whose ``.data`` user code replaced (as the step would); stage 3 releases every
        gathered unit that is not persistent (lent master rows are written back on release) and
        drops hpZ's secondary shards."""
        s = self.stage
        s.rebind_parameters(keep_values=True)
        if isinstance(s, Stage3Optimizer):
            s.coordinator.end_of_pass(keep_frozen=False)
            for u in s.units:
                u.drop_secondary()  # ZeRO++ hpZ's copies of gathered units: a cache, on the device
        if s.store.before_access is not None:
            s.store.before_access()  # no row may stay lent

    def _allocator(self, device: torch.device, pin: bool) -> Callable[[torch.Tensor], Allocate | None]:
        """The master buffer keeps a mapping of its own where it had one (fp32 ZeRO-3 on the CPU)."""
        master = self.stage.master

        def allocate(t: torch.Tensor) -> Allocate | None:
            # A mapped master shard is one buffer (never split by partial optimizer offload).
            if not (self._masters_mapped and master.flat.numel() and _key(t) == _key(master.flat)):
                return None

            def mapped(nbytes: int) -> torch.Tensor:
                if device.type != "cpu" or pin:
                    self.stage.master.adopt_mapping(None)  # device or page-locked memory: not droppable
                    return (host_empty(nbytes, torch.uint8, True) if device.type == "cpu"
                            else torch.empty(nbytes, dtype=torch.uint8, device=device))
                buffer = host_memory.MappedBuffer(nbytes)
                self.stage.master.adopt_mapping(buffer)
                return buffer.tensor(torch.uint8)

            return mapped

        return allocate

    def _after_move(self, groups: dict[_Key, list[torch.Tensor]], collect: bool = False) -> None:
        """Re-derive what was derived from the moved tensors, then free the old memory (``collect``:
        run Python's garbage collector too, as DeepSpeed's offload does: the stage's own views are
        freed without it, a script's views caught in reference cycles are not)."""
        s = self.stage
        if not groups:
            return
        s.note_parameter_data()  # stages 1-2: the tensors the parameters are bound to
        for u in self._units() + (s.frozen.units if s.frozen is not None else []):
            if u.shard is None:
                continue
            for p, shape, layout, off in zip(u.params, u.shapes, u.bucket.layouts, u.bucket.offsets):
                # Views of the shard handed out (DeepSpeed's ds_tensor): handed out again.
                own = u.shard.narrow(0, off, layout.shard_numel)
                u.observer.partitioned(p, shape, layout.world, u.persistent, own)
        accelerator = self.device.type == "cuda" and torch.cuda.is_available()
        if accelerator:
            torch.cuda.synchronize(self.device)  # non-blocking copies complete before the sources go
        if collect:
            gc.collect()
        if accelerator:
            torch.cuda.empty_cache()
        host_memory.trim(self.device)


def _gradient_tensors(sync: GradSync) -> list[torch.Tensor]:
    """The gradient sync's persistent buffer and its views (stage 1: the full accumulator and this
    rank's rows of it; stages 2-3: the shard accumulator and its per-bucket views, when it exists)."""
    return sync.held_tensors()


def _bytes_of(groups: dict[_Key, list[torch.Tensor]]) -> int:
    return sum(_nbytes(ts[0]) for ts in groups.values())


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)
