"""NVMe optimizer offload (ZeRO-Infinity): master weights and optimizer state in swap files.

Design note
-----------
Files: one per kind of per-element state, under a fresh per-rank directory in ``nvme_path``:
``master.swp`` (the fp32 masters, unless they share memory with the module's parameters) and one
file per optimizer state key (``exp_avg.swp``, ``exp_avg_sq.swp``...), created when the
optimizer first makes that state. All files share one geometry: sub-group ``k`` (see
:func:`~zeroshard.core.offload.state_store.make_subgroups`) is at an aligned byte offset and holds the
sub-group's flat range of the master layout, padding included.

Buffers: ``slots`` sub-group buffers (``buffer_count``, at most the number of sub-groups, and
with ``sub_group_size`` unset no more than fit a quarter of the shard: :func:`swap_slots`), each
one aligned host tensor per file (page-locked with an accelerator), sized for the largest
sub-group. Host memory for the state is therefore ``slots × sub-group × (1 + keys) × 4`` bytes,
whatever the model size: ``sub_group_size`` is the knob.

The step is a pipeline over sub-groups: while sub-group ``k`` is stepped, ``k+1`` (and further,
with more slots) is being read and ``k-1`` written. Every slot but the one being stepped is being
read into: a read is queued in the I/O engine right behind the writes still reading from its slot
(``after=``), so neither waits in the training thread. The first sub-groups (one per slot) are
read during the backward that ends the accumulation window (:meth:`SwappedStateStore.prefetch`),
and the last sub-groups' writes (one per slot) stay in flight after the step: they overlap the
parameter publish and the next forward and backward, and the next step's first reads queue
behind them. On an I/O-bound step that moves a slot's worth of traffic per slot out of the step.
The price is when a write error shows: not in the step that wrote, but from
:meth:`SwappedStateStore.settle`, which the next step calls first and which every reader of the
files (checkpoint save, ``safe_get_*``, load) calls first too, so no value read from a file is
one whose write failed. The error still names the file, the sub-group and the step that wrote.
At ZeRO-3 the step can be begun and left pending (:meth:`SwappedStateStore.begin_step`): the
sub-groups are stepped in order as the next forward gathers units whose masters they hold
(:meth:`SwappedStateStore.step_through`), so their reads and writes overlap that forward; the rest
before the next backward, and by :meth:`SwappedStateStore.settle` before any reader or writer of the
files. Each steps with the param groups' options of the step's start (``lr`` included: a scheduler
stepped meanwhile sets the next step's), so the values are those of the synchronous step. For the step,
each master's ``.data`` and each per-element state entry (``optimizer.state[master]["exp_avg"]``...)
are pointed at the slot; afterwards the masters go back to NaN placeholders
(:func:`~zeroshard.core.master.swapped_placeholder`) and the entries are removed, so that the
torch optimizer between steps holds only scalars (``step``). State the optimizer created during
the step (the first step) is copied into the slot before it is written. Errors of the I/O engine
name the file, the sub-group and the step.

Random access for checkpoints and ``safe_get_*`` (one parameter at a time) reads and writes the
aligned byte range around the parameter's elements, so nothing larger than one parameter is held.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.core import host_memory
from zeroshard.core.master import swapped_placeholder
from zeroshard.core.offload.aio import (
    AsyncIO,
    IOHandle,
    SwapFile,
    aligned_empty,
    check_free_space,
    release_when_collected,
    swap_dir,
)
from zeroshard.core.offload.policy import OffloadPolicy, Residency, should_pin, swap_slots
from zeroshard.core.offload.state_store import StateStore, SubGroup
from zeroshard.core.offload.swap_files import round_up
from zeroshard.errors import ConfigError, OffloadIOError

if TYPE_CHECKING:
    from zeroshard.core.master import MasterShard

__all__ = ["SwappedStateStore"]

logger = logging.getLogger("zeroshard")

MASTER = "master"
_KEY = "zero_optimization.offload_optimizer.nvme_path"
#: per-element optimizer states assumed when checking free disk space up front (Adam's two)
_EXPECTED_KEYS = 2


def _per_element(v: Any, numel: int) -> bool:
    """A state entry with one value per element of its master (``step`` is a 0-d scalar)."""
    return isinstance(v, torch.Tensor) and v.dim() >= 1 and v.numel() == numel


def _warn_if_no_saving(buffered: int, shard: int, files: int, sub_group_size: int) -> None:
    """Say so when the swap buffers hold as much host memory as the state would in memory (a
    ``sub_group_size`` at least the shard: one sub-group of everything)."""
    if buffered < shard:
        return
    mib = files * 4 / 2**20
    logger.warning(
        "zeroshard: NVMe optimizer offload with sub_group_size %d holds %.1f MiB of swap buffers in host memory, "
        "at least the %.1f MiB the optimizer state would hold without offload: nothing is saved. Leave "
        "zero_optimization.sub_group_size unset (zeroshard then picks sub-groups whose buffers hold a quarter "
        "of it) or set it below %d", sub_group_size, buffered * mib, shard * mib, shard // 4)


@contextmanager
def _hyperparameters(optimizer: torch.optim.Optimizer, options: list[dict[str, Any]]) -> Iterator[None]:
    """The optimizer's param groups with ``options`` (a step's learning rate and the rest, taken
    when it began) for the block, and as they are now after it."""
    now = [{k: g[k] for k in o} for g, o in zip(optimizer.param_groups, options)]
    for g, o in zip(optimizer.param_groups, options):
        g.update(o)
    try:
        yield
    finally:
        for g, o in zip(optimizer.param_groups, now):
            g.update(o)


class _Slot:
    """One sub-group buffer: a tensor per file, and the writes still reading from it (the next read
    into it starts after them)."""

    def __init__(self, numel: int, pin: bool) -> None:
        self.numel = numel
        self.pin = pin
        self.tensors: dict[str, torch.Tensor] = {}
        self.writes: list[IOHandle] = []

    def tensor(self, kind: str) -> torch.Tensor:
        t = self.tensors.get(kind)
        if t is None:
            t = self.tensors[kind] = aligned_empty(self.numel, torch.float32, pin=self.pin)
        return t

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class SwappedStateStore(StateStore):
    """Masters (unless aliased) and per-element optimizer state in swap files; see the module doc."""

    def __init__(self, master: MasterShard, policy: OffloadPolicy, device: torch.device, rank: int,
                 publish: Callable[[int, int, torch.Tensor], None] | None = None,
                 before_access: Callable[[], None] | None = None) -> None:
        super().__init__(master, Residency.FILE, policy.sub_group, publish, before_access)
        assert policy.optimizer_nvme_path is not None
        self.device = device
        self.swap_masters = bool(master.swapped)
        self.offsets: dict[int, int] = {}
        pos = 0
        for sg in self.subgroups:
            self.offsets[sg.index] = pos
            pos = round_up(pos + sg.numel * 4)
        self.file_bytes = max(pos, 4096)
        self.nvme_path = policy.optimizer_nvme_path
        files = (1 if self.swap_masters else 0) + _EXPECTED_KEYS
        check_free_space(self.nvme_path, files * self.file_bytes, _KEY)
        self.directory = swap_dir(self.nvme_path, rank)
        a = policy.aio
        self.io = AsyncIO(a.block_size, a.queue_depth, a.threads)
        self.files: dict[str, SwapFile] = {}
        self._release = release_when_collected(self, self.io, self.files.values(), self.directory)
        #: per-element optimizer state keys, in the order first seen
        self.keys: list[str] = []
        largest = max((sg.numel for sg in self.subgroups), default=1)
        pin = should_pin(policy.pin_memory, device)
        count = swap_slots(policy.buffer_count, [sg.numel for sg in self.subgroups], policy.auto_sub_group)
        self.slots = [_Slot(largest, pin) for _ in range(count)]
        if rank == 0 and not policy.auto_sub_group:
            _warn_if_no_saving(len(self.slots) * largest, sum(sg.numel for sg in self.subgroups),
                               files, policy.sub_group)
        #: master -> (sub-group, offset in it, elements), built on the first random access
        self._positions: dict[int, tuple[SubGroup, int, int]] = {}
        #: reads of the first sub-groups started during backward (:meth:`prefetch`)
        self._early: dict[int, list[IOHandle]] = {}
        #: writes no longer tied to a slot (a read was queued behind them) whose outcome nobody has
        #: checked yet: :meth:`settle` raises their errors
        self._unchecked: list[IOHandle] = []
        self.steps = 0
        #: a step begun and not finished (:meth:`begin_step`): its sub-groups, one per ``next``
        self._pending: Iterator[None] | None = None
        self._stepped = 0
        self._subgroup_of = {b.index: sg.index for sg in self.subgroups for b in sg.buckets}
        if self.swap_masters:
            self._create(MASTER)
            self._write_initial_masters()

    # -- files -------------------------------------------------------------------------------------
    def _create(self, kind: str) -> SwapFile:
        if kind != MASTER:
            check_free_space(self.nvme_path, self.file_bytes, _KEY)
        f = self.files[kind] = SwapFile(self.directory / f"{kind}.swp", self.file_bytes)
        return f

    def _what(self, kind: str, sg: SubGroup, step: int | None = None) -> str:
        name = "master weights" if kind == MASTER else f"optimizer state {kind!r}"
        return f"{name}, sub-group {sg.index} of {len(self.subgroups)}, optimizer step {step or self.steps}"

    def _write_initial_masters(self) -> None:
        slot = self.slots[0]
        buf = slot.tensor(MASTER)
        param_of = {id(v): p for p, v in self.master.views.items()}
        for sg in self.subgroups:
            row = buf[: sg.numel]
            row.zero_()
            for m, b, off, n in sg.slices:
                p = param_of[id(m)]
                a = self._local(sg, b, off)
                self.master.copy_initial(p, row[a : a + n])
            self.io.write(self.files[MASTER], self.offsets[sg.index], row, what=self._what(MASTER, sg)).wait()

    # -- the step ------------------------------------------------------------------------------------
    def _kinds(self) -> list[str]:
        return ([MASTER] if self.swap_masters else []) + self.keys

    def _start_read(self, sg: SubGroup, slot: _Slot, step: int | None = None) -> list[IOHandle]:
        if self.device.type == "cuda":  # the asynchronous copies published from the buffer
            torch.cuda.current_stream(self.device).synchronize()
        # The I/O engine starts the reads once the slot's last writes have ended: the caller goes on.
        after, slot.writes = slot.writes, []
        self._unchecked.extend(after)
        return [self.io.read(self.files[k], self.offsets[sg.index], slot.tensor(k)[: sg.numel],
                             what=self._what(k, sg, step), after=after) for k in self._kinds()]

    @property
    def _lookahead(self) -> int:
        # Every other slot: a read queued into the slot just stepped starts when its writes end.
        return len(self.slots) - 1

    def prefetch(self) -> None:
        """Start reading the first sub-groups now (the engine calls it when the backward that ends
        an accumulation window begins), so that their reads overlap backward instead of the step;
        each starts when the previous step's writes from its slot have ended."""
        if self._early:
            return
        for j in range(min(len(self.subgroups), self._lookahead + 1)):
            self._early[j] = self._start_read(self.subgroups[j], self.slots[j % len(self.slots)], self.steps + 1)

    def _cancel_prefetch(self) -> None:
        """Values are about to change in the files: what was read ahead is stale."""
        early, self._early = self._early, {}
        for handles in early.values():
            for h in handles:
                h.wait()

    def step(self, grads: list[torch.Tensor], skip: Collection[torch.nn.Parameter] = (),
             stepped: Callable[[SubGroup], None] | None = None,
             prepare: Callable[[SubGroup], None] | None = None) -> None:
        """The pipelined step over sub-groups: read ahead, step, write behind. The last sub-groups'
        writes are still in flight when it returns (see :meth:`settle`). ``stepped`` and
        ``prepare`` as in :meth:`StateStore.step`."""
        self.begin_step(grads, skip, stepped, prepare)
        self.finish_step()

    def begin_step(self, grads: list[torch.Tensor], skip: Collection[torch.nn.Parameter] = (),
                   stepped: Callable[[SubGroup], None] | None = None,
                   prepare: Callable[[SubGroup], None] | None = None) -> None:
        """Start a step whose sub-groups are stepped later, in order, as :meth:`step_through` asks
        for them (ZeRO-3: as the next forward gathers their units, so that the step's reads and
        writes overlap that forward) or all at once by :meth:`finish_step`, which every reader and
        writer of the state calls first (through :meth:`settle`). The step's hyperparameters are
        those of now: a scheduler that changes the learning rate meanwhile changes the next step's."""
        self.settle()  # the previous step's writes, before any of its state is used
        self.steps += 1
        options = [{k: v for k, v in g.items() if k != "params"} for g in self._opt.param_groups]
        self._pending = self._steps(grads, skip, stepped, prepare, options)
        self._stepped = 0
        self.published = True  # each sub-group publishes as it is stepped

    def step_through(self, bucket: int) -> None:
        """Step the pending step's sub-groups up to the one holding ``bucket`` (no-op without one)."""
        target = self._subgroup_of[bucket]
        while self._pending is not None and self._stepped <= target:
            self._advance()

    def finish_step(self) -> None:
        """Step every sub-group the pending step has left."""
        while self._pending is not None:
            self._advance()

    @property
    def step_pending(self) -> bool:
        """Whether a step was begun and not all of its sub-groups are stepped."""
        return self._pending is not None

    def _advance(self) -> None:
        assert self._pending is not None
        try:
            next(self._pending)
            self._stepped += 1
        except StopIteration:
            self._pending = None
        except BaseException:
            self._pending = None
            raise

    def _steps(self, grads: list[torch.Tensor], skip: Collection[torch.nn.Parameter],
               stepped: Callable[[SubGroup], None] | None, prepare: Callable[[SubGroup], None] | None,
               options: list[dict[str, Any]]) -> Iterator[None]:
        n = len(self.subgroups)
        reads, self._early = self._early, {}
        ahead = len(reads)
        lookahead = self._lookahead
        for i, sg in enumerate(self.subgroups):
            while ahead < n and ahead <= i + lookahead:
                reads[ahead] = self._start_read(self.subgroups[ahead], self.slots[ahead % len(self.slots)])
                ahead += 1
            slot = self.slots[i % len(self.slots)]
            for h in reads.pop(i):
                h.wait()
            self._bind(sg, slot)
            try:
                if prepare is not None:
                    prepare(sg)
                self.master.attach_grads(grads, skip=skip, slices=sg.slices)
                try:
                    with _hyperparameters(self._opt, options), torch.no_grad():
                        self._opt.step()
                finally:
                    self.master.detach_grads(sg.slices)
                adopted = self._adopt_new_state(sg, slot)
                if self.publish is not None:
                    masters = slot.tensor(MASTER)[: sg.numel] if self.swap_masters else \
                        self.master.flat[sg.start : sg.end]
                    self.publish(sg.start, sg.end, masters)
            finally:
                self._unbind(sg)
            if adopted:
                # The optimizer's new state for this sub-group was just freed, between small tensors
                # that stay (its ``step``): glibc cannot reuse the hole for the next sub-group's, so
                # the first step's heap grew by half the state of every sub-group. Returning the
                # freed pages costs a heap walk per sub-group, once (like zero.Init).
                host_memory.trim()
            slot.writes = [self.io.write(self.files[k], self.offsets[sg.index], slot.tensor(k)[: sg.numel],
                                         what=self._what(k, sg)) for k in self._kinds()]
            if stepped is not None:
                stepped(sg)
            if i < n - 1:
                yield
        # The last sub-groups' writes stay in flight: they overlap the parameter publish and the
        # next forward and backward, where the next step's first reads queue behind them.
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def settle(self) -> None:
        """Finish a pending step (:meth:`begin_step`), then wait for every write still in flight. A
        write error surfaces here, naming the file, the sub-group and the step that wrote: from the
        next :meth:`step`, or from whatever reads the state first (a checkpoint save,
        ``safe_get_*``, a load)."""
        self.finish_step()
        handles, self._unchecked = self._unchecked, []
        for slot in self.slots:
            handles += slot.writes
            slot.writes = []
        error: OffloadIOError | None = None
        for h in handles:  # every one ends before the first error is raised: no write is left running
            try:
                h.wait()
            except OffloadIOError as e:
                error = error or e
        if error is not None:
            raise error

    def _local(self, sg: SubGroup, b: int, off: int) -> int:
        return int(self.master.buckets[b].start + off - sg.start)

    def _bind(self, sg: SubGroup, slot: _Slot) -> None:
        state = self._opt.state
        for m, b, off, n in sg.slices:
            a = self._local(sg, b, off)
            if self.swap_masters:
                m.data = slot.tensor(MASTER)[a : a + n]
            if state.get(m):
                for k in self.keys:
                    state[m][k] = slot.tensor(k)[a : a + n]

    def _adopt_new_state(self, sg: SubGroup, slot: _Slot) -> bool:
        """Copy state the optimizer created in this step (its first) into the slot; whether any was."""
        adopted = False
        state = self._opt.state
        for m, b, off, n in sg.slices:
            a = self._local(sg, b, off)
            for k, v in list(state.get(m, {}).items()):
                if not _per_element(v, n):
                    continue
                if k not in self.keys:
                    self._new_key(k, v)
                target = slot.tensor(k)[a : a + n]
                if v.data_ptr() != target.data_ptr():
                    target.copy_(v)
                    adopted = True
        return adopted

    def _new_key(self, key: str, value: torch.Tensor) -> None:
        if value.dtype != torch.float32:
            raise ConfigError(f"NVMe optimizer offload keeps optimizer state in fp32; the optimizer made {key!r} "
                              f"in {value.dtype}", key="zero_optimization.offload_optimizer.device")
        self.keys.append(key)
        self._create(key)
        # Regions of sub-groups stepped before this key existed (no state yet) are never read for
        # masters without state; the file's zeros are fine.

    def _unbind(self, sg: SubGroup) -> None:
        state = self._opt.state
        for m, *_ in sg.slices:
            if self.swap_masters:
                m.data = swapped_placeholder(m.numel())
            st = state.get(m)
            if st:
                for k in self.keys:
                    st.pop(k, None)

    def refresh(self) -> None:
        """Publish every sub-group's masters from the file (after writes through the accessor)."""
        if self.publish is None or self.published or not self.swap_masters:
            return
        self.settle()  # the files hold the last step's values, and no slot is being written
        slot = self.slots[0]
        for sg in self.subgroups:
            if self.device.type == "cuda":  # the previous sub-group's copies out of the buffer
                torch.cuda.current_stream(self.device).synchronize()
            row = slot.tensor(MASTER)[: sg.numel]
            self.io.read(self.files[MASTER], self.offsets[sg.index], row, what=self._what(MASTER, sg)).wait()
            self.publish(sg.start, sg.end, row)
        self.published = True

    # -- random access, one parameter at a time ---------------------------------------------------------
    def _where(self, m: torch.nn.Parameter) -> tuple[SubGroup, int, int]:
        """The sub-group holding ``m``, its offset in it and its length (one lookup per parameter
        read or written: a checkpoint of many parameters does not rescan every sub-group)."""
        if not self._positions:
            self._positions = {id(mm): (sg, self._local(sg, b, off), n)
                               for sg in self.subgroups for mm, b, off, n in sg.slices}
        return self._positions[id(m)]

    def _read_elems(self, kind: str, m: torch.nn.Parameter) -> torch.Tensor:
        self.settle()  # the file's bytes must be the last step's
        sg, a, n = self._where(m)
        lo = self.offsets[sg.index] + a * 4
        base = lo - lo % 4096
        buf = aligned_empty(round_up(lo + n * 4 - base) // 4, torch.float32)
        self.io.read(self.files[kind], base, buf, what=self._what(kind, sg)).wait()
        start = (lo - base) // 4
        return buf[start : start + n].clone()

    def _write_elems(self, kind: str, m: torch.nn.Parameter, values: torch.Tensor) -> None:
        self._cancel_prefetch()
        self.settle()
        sg, a, n = self._where(m)
        lo = self.offsets[sg.index] + a * 4
        base = lo - lo % 4096
        buf = aligned_empty(round_up(lo + n * 4 - base) // 4, torch.float32)
        f = self.files[kind]
        self.io.read(f, base, buf, what=self._what(kind, sg)).wait()
        start = (lo - base) // 4
        buf[start : start + n].copy_(values.reshape(-1))
        self.io.write(f, base, buf, what=self._what(kind, sg)).wait()

    def master_values(self, master: torch.nn.Parameter) -> torch.Tensor:
        """The fp32 values of one master (read from the file when swapped)."""
        return self._read_elems(MASTER, master) if self.swap_masters else master.detach()

    def write_master(self, master: torch.nn.Parameter, values: torch.Tensor) -> None:
        """Overwrite one master's values (in its file when swapped)."""
        if not self.swap_masters:
            super().write_master(master, values)
            return
        self._write_elems(MASTER, master, values)
        self.published = False

    def state(self, master: torch.nn.Parameter) -> dict[str, Any]:
        """One master's optimizer state: scalars from memory, per-element entries read from files."""
        st = dict(self._opt.state.get(master, {}))
        if st:
            for k in self.keys:
                st[k] = self._read_elems(k, master).view(master.shape)
        return st

    def state_meta(self, master: torch.nn.Parameter) -> dict[str, Any]:
        """Like :meth:`state`, with ``meta`` tensors for the per-element entries (nothing read)."""
        st = dict(self._opt.state.get(master, {}))
        if st:
            for k in self.keys:
                st[k] = torch.empty(master.shape, dtype=torch.float32, device="meta")
        return st

    def write_state(self, master: torch.nn.Parameter, key: str, values: torch.Tensor) -> None:
        """Overwrite (or create, when loading a checkpoint) one state entry of one master."""
        if _per_element(values, master.numel()) or key in self.keys:
            if key not in self.keys:
                self._new_key(key, values.float())
            self._write_elems(key, master, values.float())
            return
        super().write_state(master, key, values)

    def load_states(self, states: dict[int, dict[str, Any]], param_groups: list[dict[str, Any]]) -> None:
        """Replace the optimizer state (per-element entries go to the files)."""
        masters = [m for g in self._opt.param_groups for m in g["params"]]
        scalars: dict[int, dict[str, Any]] = {}
        for i, st in states.items():
            m = masters[i]
            keep = {}
            for k, v in st.items():
                if _per_element(v, m.numel()):
                    self.write_state(m, k, v)
                else:
                    keep[k] = v
            scalars[i] = keep
        super().load_states(scalars, param_groups)

    def bytes_held(self) -> dict[str, dict[str, int]]:
        """Masters and optimizer state by place: the files, the sub-group buffers, the scalars."""
        place = "pinned_host" if self.slots and self.slots[0].pin else "host"
        buffers = sum(s.nbytes for s in self.slots)
        scalars = sum(v.numel() * v.element_size() for st in self._opt.state.values() for v in st.values()
                      if isinstance(v, torch.Tensor) and v.device.type != "meta") if self.optimizer else 0
        states = {"file": self.file_bytes * len(self.keys), "host": scalars}
        states[place] = states.get(place, 0) + buffers
        out: dict[str, dict[str, int]] = {"optimizer_states": states}
        if self.swap_masters:
            out["master_weights"] = {"file": self.file_bytes}
        else:
            out["master_weights"] = super().bytes_held()["master_weights"] if self.optimizer else {}
        return out

    def close(self) -> None:
        """Wait for pending writes, stop the I/O threads and remove the swap files (a step begun
        and not finished is dropped with them)."""
        self._pending = None
        try:
            self._cancel_prefetch()
        except OSError:
            pass
        try:
            self.settle()
        except OSError:
            pass  # the files are removed next: nothing would read what failed to be written
        self._release()
        self.files.clear()
