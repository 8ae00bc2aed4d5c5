"""The one accessor for master weights and optimizer state, wherever they live.

Design note
-----------
A rank's fp32 master shard is laid out bucket after bucket (see
:class:`~zeroshard.core.master.MasterShard`); the optimizer step walks it in *sub-groups*, runs
of whole buckets of at most ``sub_group_size`` elements (a bucket larger than that is a sub-group
of its own). For each sub-group the store makes the masters and their optimizer state resident,
gives the masters of that sub-group (and only those) their gradient, runs the torch optimizer's
``step()`` (parameters without a gradient are left untouched by every torch optimizer, so the
other sub-groups are not stepped twice), and sends the result where it goes: the swapped store
writes it back to its files, and a store whose masters are not where the compute-dtype
parameters are copies the updated values there.

Because every optimizer torch ships is elementwise per parameter, stepping in sub-groups gives
bit-identical results to one step over everything: offload changes where bytes live, never the
training.

:class:`StateStore` keeps everything in memory (the device, or host memory with CPU optimizer
offload, where torch creates the optimizer state on the masters' device, so the step runs on the
CPU); :class:`SplitStateStore` keeps the leading sub-groups on the device and the others in host
memory (partial offload, ``offload_optimizer.ratio``: each sub-group steps where its state is,
since torch creates a master's state on the master's device);
:class:`~zeroshard.core.offload.swapped_store.SwappedStateStore` keeps it in files. Readers
(checkpoint save and load, resharding, ``safe_get_*``, ``memory_usage()``) call
:meth:`StateStore.master_values`, :meth:`StateStore.state` and their setters, never
``optimizer.state`` or the master views directly.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.core.offload.policy import Residency, place_of
from zeroshard.core.partition import Bucket, consecutive_runs

if TYPE_CHECKING:
    from zeroshard.core.master import MasterShard

__all__ = ["SplitStateStore", "StateStore", "SubGroup", "make_subgroups", "subgroup_runs"]

#: ``(master view, bucket index, column in the bucket's row, real elements)``, as in MasterShard
Slice = tuple[torch.nn.Parameter, int, int, int]


@dataclass(frozen=True)
class SubGroup:
    """A run of consecutive buckets stepped (and swapped) together."""

    index: int
    buckets: tuple[Bucket, ...]
    slices: tuple[Slice, ...]

    @property
    def start(self) -> int:
        """First element of the sub-group in the rank's flat master layout."""
        return self.buckets[0].start

    @property
    def end(self) -> int:
        """One past its last element."""
        return self.buckets[-1].start + self.buckets[-1].numel

    @property
    def numel(self) -> int:
        """Elements, padding included."""
        return self.end - self.start


def subgroup_runs(buckets: list[Bucket], sub_group_size: int) -> list[list[Bucket]]:
    """The buckets of each sub-group: ``buckets`` (in layout order) in runs of at most
    ``sub_group_size`` elements (a bucket larger than that is a run of its own)."""
    return [run for run in consecutive_runs(buckets, lambda b: b.numel, max(1, sub_group_size)) if run]


def make_subgroups(buckets: list[Bucket], slices: list[Slice], sub_group_size: int) -> list[SubGroup]:
    """Split ``buckets`` (in layout order) into runs of at most ``sub_group_size`` elements."""
    by_bucket: dict[int, list[Slice]] = {}
    for s in slices:
        by_bucket.setdefault(s[1], []).append(s)
    return [SubGroup(i, tuple(run), tuple(s for b in run for s in by_bucket.get(b.index, ())))
            for i, run in enumerate(subgroup_runs(buckets, sub_group_size))]


class StateStore:
    """Master weights and optimizer state held in memory (device or host).

    Args:
        master: the rank's master shard (its views are what the optimizer steps).
        residency: :attr:`Residency.DEVICE` or :attr:`Residency.HOST`.
        sub_group_size: elements stepped at a time.
        publish: where updated masters go after a sub-group's step, as ``publish(start, end,
            values)`` with the sub-group's flat range and its fp32 values; ``None`` when the
            compute-dtype parameters read the masters directly (they are the same memory, or
            the stage casts them itself).
    """

    def __init__(self, master: MasterShard, residency: Residency, sub_group_size: int,
                 publish: Callable[[int, int, torch.Tensor], None] | None = None,
                 before_access: Callable[[], None] | None = None) -> None:
        self.master = master
        self.residency = residency
        self.subgroups = make_subgroups(master.buckets, master.slices, sub_group_size)
        self.publish = publish
        self.optimizer: torch.optim.Optimizer | None = None
        #: whether :attr:`publish` has every sub-group's current masters (set by a step, cleared
        #: by writes through the accessor)
        self.published = True
        #: called before the masters are read or written (the step, :meth:`refresh`,
        #: :meth:`master_values`, :meth:`write_master`): ZeRO-3 rewrites the rows it lent to
        #: gathered parameters (:mod:`zeroshard.core.zero3.lent_rows`); ``None`` when nothing is lent
        self.before_access = before_access

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """The torch optimizer over the master views (built by ``initialize`` or the client's)."""
        self.optimizer = optimizer

    @property
    def _opt(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError("the state store is used before an optimizer was bound")
        return self.optimizer

    # -- the step ------------------------------------------------------------------------------
    def prefetch(self) -> None:
        """Start bringing the first sub-groups in before the step (nothing to do in memory)."""

    def step(self, grads: list[torch.Tensor], skip: Collection[torch.nn.Parameter] = (),
             stepped: Callable[[SubGroup], None] | None = None,
             prepare: Callable[[SubGroup], None] | None = None) -> None:
        """One optimizer step over every sub-group, with this rank's gradient shard (one flat
        fp32 tensor per bucket, unscaled and clipped); masters in ``skip`` get no gradient.
        ``stepped`` is called with each sub-group once it is stepped and published (stages 1-2
        start its parameters' all-gather there), ``prepare`` just before it is stepped."""
        self._access()
        for sg in self.subgroups:
            if prepare is not None:
                prepare(sg)
            self._step_resident(sg, grads, skip)
            if self.publish is not None:
                self.publish(sg.start, sg.end, self.master.span(sg.start, sg.end))
            if stepped is not None:
                stepped(sg)
        self.published = True

    def begin_step(self, grads: list[torch.Tensor], skip: Collection[torch.nn.Parameter] = (),
                   stepped: Callable[[SubGroup], None] | None = None,
                   prepare: Callable[[SubGroup], None] | None = None) -> None:
        """Start a step that the store may leave pending, its sub-groups stepped later by
        :meth:`step_through` and :meth:`finish_step` (the swapped store does: ZeRO-3 overlaps its
        I/O with the next forward); in memory, the whole :meth:`step`."""
        self.step(grads, skip, stepped, prepare)

    def step_through(self, bucket: int) -> None:
        """Step the pending step's sub-groups up to the one holding ``bucket`` (none pending here)."""

    def finish_step(self) -> None:
        """Step every sub-group a pending step has left (none here)."""

    @property
    def step_pending(self) -> bool:
        """Whether a step was begun and not all of its sub-groups are stepped."""
        return False

    def _step_resident(self, sg: SubGroup, grads: list[torch.Tensor], skip: Collection[torch.nn.Parameter]) -> None:
        self.master.attach_grads(grads, skip=skip, slices=sg.slices)
        try:
            self._opt.step()
        finally:
            self.master.detach_grads(sg.slices)

    def refresh(self) -> None:
        """Send every sub-group's masters to :attr:`publish` unless the last step did (after a
        checkpoint load, ``GatheredParameters`` writes, ``safe_set_*``)."""
        if self.publish is None or self.published:
            return
        self._access()
        for sg in self.subgroups:
            self.publish(sg.start, sg.end, self.master.span(sg.start, sg.end))
        self.published = True

    # -- the accessor ----------------------------------------------------------------------------
    def master_values(self, master: torch.nn.Parameter) -> torch.Tensor:
        """The fp32 values of one master (a view while resident: do not modify it)."""
        self._access()
        return master.detach()

    def write_master(self, master: torch.nn.Parameter, values: torch.Tensor) -> None:
        """Overwrite one master's values."""
        self._access()
        with torch.no_grad():
            master.data.copy_(values.reshape(master.shape))
        self.published = False

    def _access(self) -> None:
        if self.before_access is not None:
            self.before_access()

    def state(self, master: torch.nn.Parameter) -> dict[str, Any]:
        """One master's optimizer state, complete (per-element tensors and scalars)."""
        return dict(self._opt.state.get(master, {}))

    def state_meta(self, master: torch.nn.Parameter) -> dict[str, Any]:
        """One master's optimizer state for its shapes and dtypes only (no values need be read)."""
        return self.state(master)

    def write_state(self, master: torch.nn.Parameter, key: str, values: torch.Tensor) -> None:
        """Overwrite one per-element (or scalar) state entry of one master."""
        st = self._opt.state[master]
        with torch.no_grad():
            if isinstance(st.get(key), torch.Tensor) and st[key].numel() == values.numel():
                st[key].copy_(values.reshape(st[key].shape))
            else:  # loading a checkpoint into an optimizer that has not stepped yet
                st[key] = values.detach().to(master.device).reshape(master.shape if values.dim() else ()).clone()

    def has_state(self, master: torch.nn.Parameter) -> bool:
        """Whether the optimizer has stepped this master yet."""
        return bool(self._opt.state.get(master))

    def load_states(self, states: dict[int, dict[str, Any]], param_groups: list[dict[str, Any]]) -> None:
        """Replace the optimizer's state: ``states`` maps a master's index (over the param groups,
        in order) to its state, per-element entries as tensors of the master's shape."""
        self._opt.load_state_dict({"state": states, "param_groups": param_groups})
        self.published = False

    def bytes_held(self) -> dict[str, dict[str, int]]:
        """Bytes of master weights and optimizer state, by where they live: ``{"master_weights":
        {"device": n, ...}, "optimizer_states": {...}}`` with places ``device``, ``host``,
        ``pinned_host`` and ``file``."""
        places: dict[str, int] = {}
        for st in self._opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    places[place_of(v)] = places.get(place_of(v), 0) + v.numel() * v.element_size()
        return {"master_weights": {place_of(self.master.flat): self.master.bytes_held()}, "optimizer_states": places}

    def close(self) -> None:
        """Release files and buffers (nothing to do in memory)."""



class SplitStateStore(StateStore):
    """Partial optimizer offload (``offload_optimizer.ratio`` below 1, DeepSpeed's ZeRO-Offload++
    "Twin-Flow"): the masters and optimizer state of the leading sub-groups on the training device,
    the others in host memory.

    The masters are two buffers (:class:`~zeroshard.core.master.KeptPrefix`), split at the start of
    the first offloaded sub-group; torch creates each master's state on the master's device, so the
    step of every sub-group runs where its state is, with the same torch optimizer (elementwise: the
    same bits as one step over everything), and :attr:`publish` takes each one's updated values
    from there.

    Args:
        master: the rank's master shard, split where ``residencies`` change.
        residencies: per sub-group (:meth:`OffloadPolicy.subgroup_residencies`), in layout order.
        device: the training device (names the bytes of :meth:`bytes_held`).
        sub_group_size, publish, before_access: as :class:`StateStore`'s.
    """

    def __init__(self, master: MasterShard, residencies: tuple[Residency, ...], device: torch.device,
                 sub_group_size: int, publish: Callable[[int, int, torch.Tensor], None] | None = None,
                 before_access: Callable[[], None] | None = None) -> None:
        super().__init__(master, Residency.HOST, sub_group_size, publish, before_access)
        if len(residencies) != len(self.subgroups):
            raise ValueError(f"{len(residencies)} residencies for {len(self.subgroups)} sub-groups")
        kept = sum(r is Residency.DEVICE for r in residencies)
        split = self.subgroups[kept].start if kept < len(self.subgroups) else master.numel
        if residencies != (Residency.DEVICE,) * kept + (Residency.HOST,) * (len(residencies) - kept) or (
                master.kept is None or master.kept.end != split):
            raise ValueError("the device's sub-groups must lead, and the master shard be split where they end")
        #: where each sub-group's masters and optimizer state are, aligned with :attr:`subgroups`
        self.residencies = residencies
        self.device = device

    def _place(self, residency: Residency, t: torch.Tensor) -> str:
        """Where ``t`` (of a sub-group at ``residency``) is, in ``memory_placement()``'s names. On a
        CPU training device both parts are host memory: the device's part is named ``device`` all
        the same, so that the split shows (without partial offload a CPU run names all ``host``)."""
        if residency is Residency.DEVICE and self.device.type == "cpu":
            return "device"
        return place_of(t)

    def bytes_held(self) -> dict[str, dict[str, int]]:
        """As :meth:`StateStore.bytes_held`, each sub-group's bytes where its residency puts them."""
        masters: dict[str, int] = {}
        states: dict[str, int] = {}
        for sg, residency in zip(self.subgroups, self.residencies):
            values = self.master.span(sg.start, sg.end)
            place = self._place(residency, values)
            masters[place] = masters.get(place, 0) + values.numel() * values.element_size()
            for view, *_ in sg.slices:
                for v in self._opt.state.get(view, {}).values():
                    if isinstance(v, torch.Tensor):
                        at = self._place(residency, v)
                        states[at] = states.get(at, 0) + v.numel() * v.element_size()
        return {"master_weights": masters, "optimizer_states": states}
