"""One ZeRO-3 unit: parameters gathered and released together by one collective.

A unit is a :class:`~zeroshard.core.partition.Bucket` (usually one module's direct parameters) whose
compute-dtype shard lives in a slice of the flat parameter-shard buffer. Its states:

- ``SHARDED``: the rank's chunk in the shard buffer is the only copy of the unit's values; every
  parameter's ``.data`` is an empty placeholder (0 elements).
- ``GATHERING``: an all-gather into a transient buffer is in flight (a prefetch); for a unit of
  one parameter (a linear layer without bias, an embedding: most of a Llama), into the full
  tensor's own storage, padded, since every rank's row end to end is that parameter: no buffer,
  no copy out of it (5-8% of a stage-3 step on the 120M bias-free GPT, CPU).
- ``GATHERED``: every parameter's ``.data`` is a full, contiguous tensor of its own. Changes made
  to it are *not* written back (see ``GatheredParameters(modifier_rank=...)`` for that).

Releasing for training frees the full tensors' *storage* in place (``resize_(0)``, as FSDP2 does;
on CPU, a large unit's tensors view one :class:`~zeroshard.core.host_memory.MappedBuffer`, outside
malloc's heap, whose pages are dropped instead) and keeps the tensors: autograd saves views of the
weights for backward (``weight.t()`` of a linear layer), which would otherwise keep every released
unit's memory alive until its backward, so that releasing after forward saved nothing. The next
gather refills the same storage, so those saved views read the gathered values again in backward.
Releasing an explicit gather (``state_dict()``, ``GatheredParameters``) only drops the references:
the caller may keep the tensors it was given.

In fp32 with the shard in host memory, a unit gathered for training holds the only copy of this
rank's row while it is gathered (the shard's pages are handed back, :mod:`~zeroshard.core.zero3.lent_rows`);
:meth:`ParamUnit.reclaim` writes the row back before the unit is released or handed out.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from zeroshard.core import host_memory
from zeroshard.core.comm import collectives as C
from zeroshard.core.comm.quantized import QuantizedGather, quantized_all_gather
from zeroshard.core.partition import INIT_CHUNK_ATTR, Bucket, full_shape, gather_from_rows, set_full_shape
from zeroshard.core.seam import NO_OBSERVER, ParamObserver, set_unit
from zeroshard.core.zero3.secondary import SecondaryShards
from zeroshard.errors import ZeroshardError

if TYPE_CHECKING:
    from zeroshard.core.offload.param_store import ParamSwapFile
    from zeroshard.core.zero3.lent_rows import RowLender

_F = TypeVar("_F", bound=Callable[..., Any])


def _outside_inference_mode(fn: _F) -> _F:
    """Run ``fn`` with inference mode off. A unit keeps its full tensors (and refills the same
    storage) across calls: made during ``torch.inference_mode()`` (``generate()`` in an evaluation
    loop) they would be inference tensors, which the next training step cannot save for backward
    nor refill in place. Plain tensors work in both."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


class UnitState(enum.Enum):
    """Where a unit's parameter values live right now."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class ParamUnit:
    """Parameters of one unit, with their shard and the gather/release transitions."""

    def __init__(self, bucket: Bucket, shard: torch.Tensor | None, group: dist.ProcessGroup | None,
                 persistent: bool, name: str, device: torch.device | None = None, swap: ParamSwapFile | None = None,
                 dtype: torch.dtype | None = None, *, frozen: bool = False, lender: RowLender | None = None,
                 observer: ParamObserver = NO_OBSERVER, quantize_block: int | None = None,
                 secondaries: SecondaryShards | None = None) -> None:
        self.bucket = bucket
        #: ``[bucket.numel]`` view into the flat shard buffer: the compute-dtype shard (on the device,
        #: or in host memory with parameter offload), or the fp32 masters themselves (cast when
        #: gathered); ``None`` when the shard lives in ``swap``'s file
        self.shard = shard
        #: the parameter swap file (:class:`~zeroshard.core.offload.param_store.ParamSwapFile`) with NVMe
        #: parameter offload
        self.swap = swap
        #: where gathered parameters live (the training device)
        self.device = device if device is not None else (shard.device if shard is not None else torch.device("cpu"))
        self.dtype = dtype if dtype is not None else (shard.dtype if shard is not None else torch.float32)
        self._read: Any = None  # a swap-file read in flight (NVMe parameter offload)
        self.group = group
        self.world = C.world_size(group)
        self.persistent = persistent
        #: the parameters are frozen (never updated): gathered values stay valid across steps
        self.frozen = frozen
        #: told of the parameters' sharding and of each state change (DeepSpeed's ``ds_*`` attributes)
        self.observer = observer
        self.name = name
        self.gather_what = f"all-gather of ZeRO-3 unit {name!r}"  # for errors; built once, not per gather
        self._state = UnitState.SHARDED
        self.shapes = [full_shape(p) for p in bucket.params]
        #: elements of the unit's gathered parameters (read on every fetch and prefetch: not re-summed)
        self.numel = sum(layout.numel for layout in bucket.layouts)
        #: a unit of one parameter (a linear layer without bias, an embedding): every rank's row,
        #: end to end, is the flattened parameter and its padding, so the all-gather lands in the
        #: full tensor's own storage, with no buffer to copy out of
        self.direct = (len(bucket.params) == 1 and bucket.offsets[0] == 0
                       and bucket.numel == bucket.layouts[0].shard_numel)
        #: a direct unit's padded flat tensor, which its full tensor views (the all-gather output)
        self._landing: torch.Tensor | None = None
        self._pending: tuple[torch.Tensor, dist.Work | QuantizedGather | None] | None = None
        #: the full tensors of the last gather whose storage was freed in place: refilled (same
        #: storage) by the next gather, for the views autograd saved of them
        self._freed: list[torch.Tensor] | None = None
        #: on CPU, for a large unit: the mapping its full tensors view (``None`` when they are plain
        #: tensors), and the one its all-gathers land in
        self._full_map: host_memory.MappedBuffer | None = None
        self._out_map: host_memory.MappedBuffer | None = None
        #: fp32 in host memory: takes the shard's row back while the unit is gathered for training
        #: (:mod:`~zeroshard.core.zero3.lent_rows`); ``None`` where the gathered values are no copy of it
        self.lender = lender
        #: ZeRO++ qwZ: the all-gather carries int8 blocks of this many elements and their scales
        self.quantize_block = quantize_block
        #: ZeRO++ hpZ: the group whose secondary shards a gather in the same pass comes from
        self.secondaries = secondaries
        #: this rank's secondary shard (:mod:`~zeroshard.core.zero3.secondary`), while valid
        self._secondary: torch.Tensor | None = None
        #: the gathered values (or the gather in flight) came through qwZ's quantization
        self.quantized_values = False
        self._exact = False

    @property
    def state(self) -> UnitState:
        """Where the unit's values are (the observer hears of each change: DeepSpeed's ``ds_status``)."""
        return self._state

    @state.setter
    def state(self, state: UnitState) -> None:
        self._state = state
        self.observer.state_changed(self.bucket.params, state)

    def adopt(self) -> None:
        """Take over the unit's parameters once its shard holds their values: placeholders from now
        on. The module's full tensors are the caller's: dropped, not freed under it."""
        for p, shape, layout, off in zip(self.params, self.shapes, self.bucket.layouts, self.bucket.offsets):
            set_unit(p, self)
            set_full_shape(p, shape)
            own = self.shard.narrow(0, off, layout.shard_numel) if self.shard is not None else None
            self.observer.partitioned(p, shape, layout.world, self.persistent, own)
            if hasattr(p, INIT_CHUNK_ATTR):
                delattr(p, INIT_CHUNK_ATTR)  # a zero.Init chunk, copied into (or adopted as) the shard
        self.state = UnitState.GATHERED
        self.release(free_storage=False)

    def position(self, p: torch.nn.Parameter) -> int:
        """Index of ``p`` in :attr:`params` (by identity: ``list.index`` compares tensors' values)."""
        return next(i for i, q in enumerate(self.params) if q is p)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The unit's parameters, in layout order."""
        return self.bucket.params

    @_outside_inference_mode
    def launch_gather(self, exact: bool = False) -> None:
        """Start the all-gather (no-op unless ``SHARDED``); ``exact``: not quantized even with qwZ
        (an explicit gather: values a user reads, exports or changes)."""
        if self.state is not UnitState.SHARDED:
            return
        self._exact = exact
        if self._secondary is not None and self.secondaries is not None and not (exact and self.quantized_values):
            # inside the hpZ group only (not for an exact gather when the secondary holds quantized values)
            out = self._gather_output(self.world * self.bucket.numel)
            self._pending = (out, C.all_gather(out, self._secondary.view(-1), self.secondaries.group,
                                               what=self.gather_what))
        elif self.swap is not None:  # the all-gather starts once the read has landed (wait_gather)
            self._read = self.swap.read(self.bucket.index)
        else:
            # A collective that fails to start (a rank missing, a block other ranks skip) leaves
            # the unit sharded, so that the next gather on every rank starts afresh.
            self._start_all_gather(self.shard)
        self.state = UnitState.GATHERING

    def _start_all_gather(self, shard: torch.Tensor | None, pooled: bool = False) -> None:
        assert shard is not None
        # Quantized, the fp32 masters are quantized as they are (no cast first: one rounding, not two).
        quantizing = self.quantize_block is not None and not self._exact
        dtype = shard.dtype if quantizing and shard.dtype.is_floating_point else self.dtype
        if shard.device != self.device or shard.dtype != dtype:
            # Parameter offload (host memory to the device), or the fp32 masters cast on the way.
            # A pooled swap buffer goes back to the pool (and is refilled) right after: copy blocking.
            shard = shard.to(self.device, dtype, non_blocking=not pooled)
        out = self._gather_output(self.world * self.bucket.numel)
        self.quantized_values = self.quantize_block is not None and not self._exact
        if self.quantized_values:
            assert self.quantize_block is not None
            self._pending = (out, quantized_all_gather(out, shard, self.group, self.quantize_block))
        else:
            self._pending = (out, C.all_gather(out, shard, self.group, what=self.gather_what))

    def _gather_output(self, numel: int) -> torch.Tensor:
        """Where an all-gather of the unit lands: the full tensor itself (a direct unit), a
        mapping of its own (a large unit on CPU), or a new tensor."""
        if self.direct:
            return self._direct_landing(numel)
        if host_memory.mappable(self.device, numel * self.dtype.itemsize):
            if self._out_map is None:
                self._out_map = host_memory.MappedBuffer(numel * self.dtype.itemsize)
            return self._out_map.tensor(self.dtype)
        return torch.empty(numel, dtype=self.dtype, device=self.device)

    def drop_secondary(self) -> None:
        """Let go of the hpZ secondary shard (the pass ended, or the values are about to change)."""
        if self._secondary is not None and self.secondaries is not None:
            self.secondaries.dropped(self._secondary)
        self._secondary = None

    @property
    def in_flight(self) -> bool:
        """Whether the unit's all-gather has been started and not yet waited for."""
        return self.state is UnitState.GATHERING

    def lend_in_flight(self) -> None:
        """A prefetch for training: hand the shard's row to the all-gather in flight now, when it
        has already copied the row into its output (the CPU ring), rather than when the unit's
        forward waits for it. The default prefetch gathers a small model whole in its first
        module; lent only at each unit's forward, the rank held the landed gathers and its own
        rows together at the start of forward, 1/N of the model more than at its end."""
        if (self.lender is not None and self.in_flight and self._pending is not None
                and C.input_copied(self._pending[1])):
            self.lender.lend(self)

    def own_row(self, rank: int) -> torch.Tensor:
        """This rank's row of the unit, in the shard's layout: from the gathered tensors' landing
        buffer while the all-gather is in flight (the collective never writes this rank's row)."""
        assert self.in_flight and self._pending is not None
        return self._pending[0].view(self.world, self.bucket.numel)[rank]

    def check_dtype(self) -> None:
        """Raise when user code converted the unit's parameters (``model.half()``, ``model.to(dtype)``
        after ``initialize``): the next gather would put them back in the unit's dtype, so the forward
        would mix dtypes (torch's "mat1 and mat2 must have the same dtype") or train another copy."""
        for p in self.params:
            if p.dtype is not self.dtype:
                raise ZeroshardError(
                    f"a parameter of ZeRO-3 unit {self.name!r} is {p.dtype} but the unit trains in {self.dtype}: "
                    "its dtype was changed after initialize (model.half(), model.to(dtype)), which ZeRO-3 does "
                    "not support. Choose the training dtype with the config's bf16 or fp16 block, or convert "
                    "the model before initialize")

    @_outside_inference_mode
    def wait_gather(self, lend: bool = False) -> None:
        """Finish a gather: full parameter tensors in place of the placeholders. With ``lend`` (a
        gather for training), the shard's row may be handed to them until the unit is released."""
        if self.state is UnitState.SHARDED:
            self.launch_gather()
        if self.state is UnitState.GATHERED and lend and self.lender is not None and not self.lender.holds(self):
            # still gathered from the last micro-step (its row read back since: a checkpoint, safe_get_*)
            self.lender.lend(self)
        if self.state is not UnitState.GATHERING:
            return
        if self._read is not None:
            read, self._read = self._read, None
            try:
                self._start_all_gather(read.wait(), pooled=True)
                out, work = self._pending if self._pending is not None else (None, None)
                if work is not None:
                    work.wait()  # the buffer goes back to the pool only once the collective has read it
            finally:
                read.release()
        assert self._pending is not None
        out, work = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        rows = out.view(self.world, self.bucket.numel)
        if (self.secondaries is not None and self._secondary is None and not self.persistent
                and torch.is_grad_enabled()):  # a forward for training: its backward may gather again
            self._secondary = self.secondaries.keep(rows)
        fulls, self._freed = self._freed if self._freed is not None else self._new_full_tensors(), None
        for p, full, layout, off in zip(self.params, fulls, self.bucket.layouts, self.bucket.offsets):
            if not self.direct:  # a direct unit's gather landed in place
                if full.untyped_storage().nbytes() < full.numel() * full.element_size():  # freed by resize_(0)
                    full.untyped_storage().resize_(full.numel() * full.element_size())
                gather_from_rows(rows[:, off : off + layout.shard_numel], full.view(-1))
            p.data = full
        if self._out_map is not None:
            self._out_map.drop()
        self.state = UnitState.GATHERED
        if lend and self.lender is not None:
            self.lender.lend(self)

    def _direct_landing(self, numel: int) -> torch.Tensor:
        """A direct unit's all-gather output: the padded flat tensor its full tensor views, refilled
        in place when its storage was freed (autograd's saved views then read the new values)."""
        if self._freed is None:  # none of ours to refill: new full tensors, for wait_gather to take
            self._freed = self._new_full_tensors(padded=numel)
        assert self._landing is not None
        storage = self._landing.untyped_storage()
        if storage.nbytes() < numel * self.dtype.itemsize:  # freed by resize_(0)
            storage.resize_(numel * self.dtype.itemsize)
        return self._landing

    def _new_full_tensors(self, padded: int | None = None) -> list[torch.Tensor]:
        """Full tensors for the unit's parameters; with ``padded``, views of one flat tensor of that
        many elements (a direct unit's all-gather output, kept in :attr:`_landing`; none for a
        parameter with no elements, whose landing is still that empty tensor)."""
        numels = [shape.numel() for shape in self.shapes]
        total = max(sum(numels), padded or 0)
        nbytes = total * self.dtype.itemsize
        if host_memory.mappable(self.device, nbytes):
            self._full_map = host_memory.MappedBuffer(nbytes)
            flat = self._full_map.tensor(self.dtype)
        elif padded is not None:
            self._full_map = None
            flat = torch.empty(total, dtype=self.dtype, device=self.device)
        else:
            self._full_map = None
            return [torch.empty(shape, dtype=self.dtype, device=self.device) for shape in self.shapes]
        if padded is not None:
            self._landing = flat[:padded]
        return [t.view(shape) for t, shape in zip(flat[: sum(numels)].split(numels), self.shapes)]

    @_outside_inference_mode
    def release(self, free_storage: bool = True) -> None:
        """Drop the gathered tensors; the shard remains the only copy. With ``free_storage`` their
        storage is freed in place (views autograd saved of them included) and refilled by the
        next gather; without, only the references are dropped."""
        if self.state is UnitState.GATHERING:
            self.wait_gather()
        if self.state is UnitState.GATHERED:
            self.reclaim()
            full = [p.data for p in self.params]
            for p in self.params:
                p.data = torch.empty(0, dtype=self.dtype, device=self.device)
            if free_storage:
                if self._full_map is not None:
                    self._full_map.drop()
                else:
                    for t in full:
                        t.untyped_storage().resize_(0)
                self._freed = full
            else:  # the caller may keep them: the next gather needs tensors of its own
                self._full_map = None
            self.state = UnitState.SHARDED

    def write_back(self, rank: int, master_views: list[torch.Tensor] | None) -> None:
        """Copy the gathered values' local chunk into the shard (and fp32 masters, if given)."""
        assert self.state is UnitState.GATHERED
        self.drop_secondary()
        self.reclaim()
        shard = self._read_row() if self.swap is not None else self.shard
        assert shard is not None
        for i, (p, layout, off) in enumerate(zip(self.params, self.bucket.layouts, self.bucket.offsets)):
            s, e = layout.local_range(rank)
            values = p.data.reshape(-1)[s:e]
            shard[off : off + (e - s)].copy_(values)
            if master_views is not None:
                master_views[i].data.copy_(values)
        if self.swap is not None:
            self.swap.write(self.bucket.index, shard)

    def write_shard(self, off: int, values: torch.Tensor) -> None:
        """Overwrite elements ``[off, off + len(values))`` of this rank's chunk of the unit."""
        self.drop_secondary()
        if self.swap is None:
            assert self.shard is not None
            self.reclaim()
            self.shard[off : off + values.numel()].copy_(values)
            return
        row = self._read_row()
        row[off : off + values.numel()].copy_(values)
        self.swap.write(self.bucket.index, row)

    def check_unmodified(self) -> None:
        """Raise if a parameter was changed in place while this unit's row is lent (see lent_rows)."""
        if self.lender is not None:
            self.lender.check_unmodified(self)

    def reclaim(self) -> None:
        """Make the shard hold this unit's row again if it was lent to the gathered tensors."""
        if self.lender is not None:
            self.lender.reclaim(self)

    def _read_row(self) -> torch.Tensor:
        """A private copy of this rank's chunk of the unit, read from the swap file."""
        if self.swap is None:
            raise RuntimeError(f"ZeRO-3 unit {self.name!r} has no swap file to read its row from")
        read = self.swap.read(self.bucket.index)
        try:
            return torch.Tensor.clone(read.wait())
        finally:
            read.release()
