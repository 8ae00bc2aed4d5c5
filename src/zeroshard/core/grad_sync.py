"""Gradient synchronisation: from autograd hooks to reduced, averaged gradient shards.

Design note
-----------
A post-accumulate-grad hook on every trained parameter moves ``p.grad`` into a bucket buffer
(laid out ``[world, bucket.numel]``, see :mod:`zeroshard.core.partition.layout`) and frees it, so the
module never holds its own ``.grad``. Buckets launch strictly in index order (a bucket goes out
once it and every earlier bucket are complete), so ranks issue identical collective sequences even
when data-dependent control flow leaves different parameters unused; whatever is still pending
launches when backward returns. With ``overlap_comm`` a bucket's collective runs while autograd
computes the remaining gradients. Without it, stages 0–1 launch everything when backward returns
(their accumulators are full-size anyway), while stage 2 still reduces each bucket as it fills and
waits for it, as DeepSpeed does: deferring would hold a buffer for every bucket, the whole
model's gradients.

Three strategies, one per stage:

- :class:`AllReduceSync` (stage 0): full-size accumulator, all-reduced at the accumulation
  boundary. Every rank ends up with the whole averaged gradient.
- :class:`BoundaryReduceScatterSync` (stage 1): full-size accumulator, reduce-scattered at the
  boundary, so each rank keeps only its shard for the optimizer step.
- :class:`MicroStepReduceScatterSync` (stage 2): every micro-step's gradients are reduce-scattered
  as buckets fill and added to a persistent accumulator of this rank's shard only; full-size
  gradients exist only transiently, bucket by bucket.

Gradients are averaged over ranks (stages 0–1 divide by the world size as they write, stage 2
after each collective) and accumulated in the policy's ``grad_accum_dtype`` (fp32 by default).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from zeroshard.core import host_memory
from zeroshard.core.comm import collectives as C
from zeroshard.core.comm.quantized import QuantizedReduction, qgz_bucket_block_size
from zeroshard.core.partition import COMM_BUFFERS, Bucket, full_shape, scatter_into_rows
from zeroshard.core.precision import PrecisionPolicy
from zeroshard.core.weak_hooks import remove_when_collected, weak_method_hook
from zeroshard.errors import ZeroshardError

#: Stage 2/3 bucket buffers kept for reuse; a bucket that finds none free waits for the oldest
#: collective in flight rather than allocating (DDP keeps one per bucket).
MAX_BUFFERS = COMM_BUFFERS

#: Collectives in flight at most: launching one more first completes the oldest, so their
#: transient buffers (gloo's receive chunks) stay bounded and their results are folded in during
#: backward rather than all at its end.
MAX_INFLIGHT = 3

_Pending = tuple[Bucket, Callable[[], None]]


class GradSync:
    """Base class: hook bookkeeping and in-order bucket launching."""

    #: reduce each bucket as it fills even without ``overlap_comm`` (waiting for it there)
    reduce_as_filled = False
    #: every backward reduces (stages 2-3), not only the window's last: ranks must agree before each
    reduces_every_micro_step = False

    def __init__(self, buckets: list[Bucket], group: dist.ProcessGroup | None, policy: PrecisionPolicy,
                 device: torch.device, overlap_comm: bool, acc_device: torch.device | None = None, *,
                 scaling: tuple[float, float] | None = None, ordered: bool = True,
                 on_param_done: Callable[[torch.nn.Parameter], None] | None = None,
                 replicate: dist.ProcessGroup | None = None) -> None:
        #: Launch strictly in bucket order (stages 0-2). ZeRO-3 launches each unit as it completes:
        #: its all-gathers already require every rank to run modules in the same order.
        self.ordered = ordered
        #: Called with each parameter once its gradient has been written (ZeRO-3 releases units).
        self.on_param_done = on_param_done
        self.buckets = buckets
        self.group = group
        self.world = C.world_size(group)
        #: hybrid sharding: the ranks holding the same shard in the other groups; reduced shards are
        #: all-reduced over them (``None``: the group is the whole data-parallel world)
        self.replicate = replicate
        self.replicas = C.world_size(replicate) if replicate is not None else 1
        #: ranks the gradient is averaged over: every group's and every replica's
        self.avg_world = self.world * self.replicas
        self.policy = policy
        self.device = device
        #: where the persistent gradient shard accumulates (host memory with optimizer offload)
        self.acc_device = acc_device if acc_device is not None else device
        self.overlap_comm = overlap_comm
        self.layout_world = buckets[0].layouts[0].world if buckets and buckets[0].layouts else 1
        #: this rank's row in the ``[layout_world, bucket.numel]`` layout
        self.row = C.rank(group) if self.layout_world > 1 else 0
        self.shard_numel = sum(b.numel for b in buckets)
        self._where: dict[torch.nn.Parameter, tuple[Bucket, int]] = {
            p: (b, i) for b in buckets for i, p in enumerate(b.params)
        }
        self._params = list(self._where)
        self._index = {p: k for k, p in enumerate(self._params)}
        self._seen: set[int] = set()  # parameters that received a gradient in this window
        #: stage 0: the reduced gradient each parameter's ``.grad`` shows between backward and step
        self._exposed: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._pending: list[_Pending] = []
        self._launched: set[int] = set()
        self._next_launch = 0
        self.boundary = True
        #: inside ``engine.backward``: only then do gradients go to the buckets. Another backward
        #: through the model (a plain ``loss.backward()`` for an input gradient, another engine's
        #: backward through this model: a GAN's generator loss) leaves ``.grad`` where autograd put
        #: it, as plain PyTorch, for the script to clear (``module.zero_grad()``) or to be added to
        #: the next ``engine.backward``'s (the step refuses any left over: :meth:`stray_grads`).
        self.active = False
        #: whether a boundary backward reduced the gradients of this window
        self.reduced = False
        #: ``(pre, post)``: gradients are multiplied by ``pre`` before the reduction and by ``post``
        #: after it (DeepSpeed's ``prescale_gradients`` / ``gradient_predivide_factor``);
        #: ``None``: the stage's own placement of the 1/world average
        self.scaling = scaling
        for p in self._where:
            self._handles.append(p.register_post_accumulate_grad_hook(weak_method_hook(self._on_grad)))
        remove_when_collected(self, self._handles)

    #: the gradient shard is file-backed (NVMe optimizer offload, stages 2-3)
    spills = False

    def held_tensors(self) -> list[torch.Tensor]:
        """The persistent gradient buffer and its views that the stage reads (for moving them
        elsewhere: ``engine.offload_states``); none where gradients live only in transient buckets."""
        return []

    def release_pages(self, t: torch.Tensor) -> None:
        """Take the pages of ``t``, a view of the gradient shard, out of the process (spilled only)."""

    def discard_pages(self, t: torch.Tensor) -> None:
        """Throw away ``t``, a view of the gradient shard no longer read (spilled only): its pages
        leave the process and the page cache without being written to the disk."""

    def spilled_bytes(self) -> int:
        """Bytes of the gradient shard in a file-backed buffer (0 unless spilled)."""
        return 0

    def _across_replicas(self, row: torch.Tensor) -> torch.Tensor:
        """Hybrid sharding: ``row`` reduced inside this group, summed over the replicas too."""
        if self.replicate is not None:
            C.all_reduce(row, self.replicate, async_op=False)
        return row

    def received_gradients(self) -> bool:
        """Whether any parameter received a gradient in this accumulation window."""
        return bool(self._seen)

    # -- hooks -------------------------------------------------------------------------------
    def start_backward(self, boundary: bool) -> None:
        """Called before ``loss.backward()``: whether this micro-step ends the accumulation window."""
        self.boundary = boundary
        self.active = True
        self._next_launch = 0
        self._launched.clear()
        for b in self.buckets:
            b.ready.clear()

    def _on_grad(self, p: torch.Tensor) -> None:
        bucket, i = self._where[p]  # type: ignore[index]
        grad = p.grad
        if grad is None or not self.active:
            return
        k = self._index[p]  # type: ignore[index]
        if grad.numel() != bucket.layouts[i].numel:
            raise ZeroshardError(
                f"a trained parameter of {bucket.layouts[i].numel} elements got a gradient of shape "
                f"{tuple(grad.shape)}: its .data was replaced by one of another shape after initialize, which its "
                "master weights and optimizer state cannot follow. Copy values into it instead (with "
                "torch.no_grad(): p.copy_(new)), or change the model before initialize")
        self._write(bucket, i, grad.detach().reshape(-1), first_in_window=k not in self._seen)
        p.grad = None
        self._seen.add(k)
        bucket.ready.add(i)
        complete = len(bucket.ready) == len(bucket.params)
        if self.on_param_done is not None:
            self.on_param_done(p)  # type: ignore[arg-type]
        if not ((self.overlap_comm or self.reduce_as_filled) and self._launches_now()):
            return
        if self.ordered:
            self._launch_ready()
        elif complete:
            self._launch_bucket(bucket)
        if not self.overlap_comm:
            while self._pending:
                self._complete_oldest()

    def finish_backward(self) -> None:
        """Called after ``loss.backward()``: launch what is left, in order, and wait for all of it."""
        if self._launches_now():
            for b in self.buckets:
                self._launch_bucket(b)
        while self._pending:
            self._complete_oldest()
        self.reduced = self.reduced or self.boundary
        self.active = False

    def stray_grads(self) -> list[torch.nn.Parameter]:
        """Trained parameters holding a ``.grad`` that no ``engine.backward`` took (see :attr:`active`)."""
        return [p for p in self._params if p.grad is not None and p not in self._exposed]

    def take_exposed(self) -> set[torch.nn.Parameter]:
        """Fold what the script did to the exposed ``.grad`` (stage 0) back into the reduced gradients:
        edited in place (``clip_grad_norm_``) is already there, a tensor assigned is copied in, and
        ``None`` (set by the script, or ``module.zero_grad()``) drops the gradient. Returns the
        parameters dropped, which the step leaves untouched, as a torch optimizer skips a ``None`` grad."""
        dropped = set()
        for p, view in self._exposed.items():
            g = p.grad
            if g is None:
                view.zero_()  # out of the norm too, as for plain PyTorch's clip over the remaining grads
                dropped.add(p)
            elif g is not view:
                view.copy_(g.detach())
            p.grad = None
        self._exposed.clear()
        return dropped

    def _withdraw_exposed(self) -> None:
        for p, view in self._exposed.items():
            if p.grad is view:
                p.grad = None
        self._exposed.clear()

    def _complete_oldest(self) -> None:
        _bucket, finalize = self._pending.pop(0)
        finalize()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if len(b.ready) < len(b.params):
                return
            self._launch_bucket(b)
            self._next_launch += 1

    def _launch_bucket(self, b: Bucket) -> None:
        if b.index in self._launched:
            return
        self._launched.add(b.index)
        while len(self._pending) >= MAX_INFLIGHT:
            self._complete_oldest()
        self._pending.append((b, self._launch(b)))

    @staticmethod
    def _zero_unwritten(rows: torch.Tensor, bucket: Bucket, written: Callable[[int], bool]) -> None:
        """Zero the column blocks of ``bucket``'s parameters that received no gradient.

        Buffers are reused, not zero-filled, so a parameter that was not written holds stale values.
        """
        for i, (off, layout) in enumerate(zip(bucket.offsets, bucket.layouts)):
            if not written(i):
                rows[:, off : off + layout.shard_numel].zero_()

    def unused_params(self) -> list[torch.nn.Parameter]:
        """Parameters that no rank produced a gradient for in this accumulation window.

        Plain PyTorch leaves their ``.grad`` as ``None`` and optimizers skip them (no momentum
        step); zero gradients would not be the same training. One small all-reduce per step.
        """
        used = torch.zeros(len(self._index), dtype=torch.uint8, device=self.device)
        if self._seen:
            used[sorted(self._seen)] = 1
        C.all_reduce(used, self.group, async_op=False, op=dist.ReduceOp.MAX)
        return [self._params[k] for k in torch.nonzero(used == 0).flatten().tolist()]

    def remove_hooks(self) -> None:
        """Detach from the parameters (the engine is being torn down)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, default: float) -> float:
        return default if self.scaling is None else self.scaling[0]

    def _post(self, default: float) -> float:
        return default if self.scaling is None else self.scaling[1]

    # -- strategy ----------------------------------------------------------------------------
    def _launches_now(self) -> bool:
        """Whether collectives are issued in this micro-step."""
        return self.boundary

    def _write(self, bucket: Bucket, i: int, grad: torch.Tensor, first_in_window: bool) -> None:
        raise NotImplementedError

    def _launch(self, bucket: Bucket) -> Callable[[], None]:
        """Start ``bucket``'s collective; returns what waits for it and uses the result."""
        raise NotImplementedError

    def shard_grads(self) -> list[torch.Tensor]:
        """This rank's averaged gradient shard after the boundary: one flat tensor per bucket
        (``bucket.numel`` elements, padding slots zero), in bucket order."""
        raise NotImplementedError

    def zero(self) -> None:
        """Forget accumulated gradients (after a step, or a skipped one)."""
        self._withdraw_exposed()
        self._seen.clear()
        self.reduced = False

    def bytes_held(self) -> int:
        """Bytes of gradient state that persist between steps on this rank."""
        raise NotImplementedError

    def workspace_bytes(self) -> int:
        """Bytes of reusable communication buffers (bounded, not model state)."""
        return 0


class _FullAccumulatorSync(GradSync):
    """Stages 0 and 1: accumulate full gradients locally; communicate only at the boundary.

    The first gradient of a window is copied into the accumulator and later ones are added, so
    the accumulator is never zero-filled after a step; parameters that no micro-step wrote are
    zeroed just before the collective. Stage 1 divides gradients by the world size as they are
    written, so the reduced sum is already the average (exact for powers of two) and no pass over
    the result is needed; stage 0 divides after the all-reduce, so that its accumulator is
    PyTorch's ``.grad`` in between (:class:`AllReduceSync`).
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.acc_device = self.device  # reduced where it is accumulated; the step moves its shard
        # Never read before written: the first gradient of a window is copied in (padding zeroed),
        # unwritten parameters are zeroed before the collective.
        self.acc = torch.empty(self.layout_world * self.shard_numel, dtype=self.policy.grad_accum_dtype,
                               device=self.device)
        #: this rank's row of every bucket: where its averaged gradient shard ends up
        self._own = [self._rows(b)[self.row] for b in self.buckets]

    def start_backward(self, boundary: bool) -> None:
        if boundary and self.reduced:
            # Another backward in the boundary micro-step (several losses, each with its own
            # backward): the accumulator holds the reduced average already. Reducing it again with
            # the new gradients added would count the earlier ones once per rank.
            self._unreduce()
        super().start_backward(boundary)

    def _unreduce(self) -> None:
        """Turn the reduced accumulator back into a contribution whose reduction gives it again."""
        raise NotImplementedError

    def _rows(self, bucket: Bucket) -> torch.Tensor:
        a = self.layout_world * bucket.start
        return self.acc[a : a + bucket.full_numel].view(self.layout_world, bucket.numel)

    def _pre_default(self) -> float:
        """The factor gradients are written with (the stage's placement of the 1/world average)."""
        return self._pre(1.0 / self.avg_world)

    def _write(self, bucket: Bucket, i: int, grad: torch.Tensor, first_in_window: bool) -> None:
        off, k = bucket.offsets[i], bucket.layouts[i].shard_numel
        scatter_into_rows(self._rows(bucket)[:, off : off + k], grad, accumulate=not first_in_window,
                          alpha=self._pre_default())

    def _wire(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's accumulator region, complete, in the reduction dtype."""
        rows = self._rows(bucket)
        self._zero_unwritten(rows, bucket, lambda i: self._index[bucket.params[i]] in self._seen)
        region = rows.view(-1)
        rd = self.policy.reduce_dtype
        return region if region.dtype == rd else region.to(rd)

    def shard_grads(self) -> list[torch.Tensor]:
        if not self.reduced:  # a step without any backward in its window: no gradient at all
            for own in self._own:
                own.zero_()
        return self._own

    def bytes_held(self) -> int:
        return self.acc.numel() * self.acc.element_size()


class AllReduceSync(_FullAccumulatorSync):
    """Stage 0: all-reduce the full accumulator bucket by bucket; every rank keeps everything.

    Gradients accumulate as plain PyTorch's ``.grad`` does (not divided by the world size) and the
    average is taken after the all-reduce, so between backward and step each parameter's ``.grad``
    can be a view of its accumulated gradient, as DeepSpeed's stage 0 and DDP leave it: this rank's
    sum between micro-steps (``no_sync`` included), the averaged one after the window's last
    backward. A script can read it (``p.grad.norm()``), clip it by hand, assign it, or set it to
    ``None`` (``module.zero_grad()``) to drop it, and the next backward or the step takes what it
    finds (:meth:`take_exposed`). fp32 training only, where the accumulator has the parameter's
    dtype and no loss scale, and without ``prescale_gradients``/``gradient_predivide_factor``.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        #: ``(parameter, index, view of its gradient in the accumulator)`` for the parameters whose
        #: ``.grad`` it can be, built at the first backward (after ``initialize`` casts the model)
        self._grad_views: list[tuple[torch.nn.Parameter, int, torch.Tensor]] | None = None

    def _pre_default(self) -> float:
        return self._pre(1.0)

    def _post_default(self) -> float:
        return self._post(1.0 / self.world)

    def start_backward(self, boundary: bool) -> None:
        if self._exposed:  # the script may have edited or dropped .grad since the last backward
            dropped = self.take_exposed()
            self._seen.difference_update(self._index[p] for p in dropped)
        super().start_backward(boundary)

    def finish_backward(self) -> None:
        super().finish_backward()
        reduced = self.boundary and self.reduced
        if not reduced and self._pre_default() != 1.0:  # a scaled local sum is not PyTorch's .grad
            return
        if self._grad_views is None:
            # fp32 only: 16-bit parameters' gradient is in another dtype (and scaled in fp16)
            self._grad_views = [
                (p, self._index[p], region[off : off + p.numel()].view(p.shape))
                for b in self.buckets for region in [self._rows(b)[0]] for p, off in zip(b.params, b.offsets)
                if p.dtype == region.dtype == torch.float32 and p.device == region.device]
        for p, k, view in self._grad_views:
            if reduced or k in self._seen:  # between micro-steps the rest of the buffer holds old values
                self._exposed[p] = view
                p.grad = view

    def _launch(self, bucket: Bucket) -> Callable[[], None]:
        region = self._rows(bucket).view(-1)
        wire = self._wire(bucket)
        work = C.all_reduce(wire, self.group)

        def finalize() -> None:
            if work is not None:
                work.wait()
            if wire is not region:
                region.copy_(wire)
            if self._post_default() != 1.0:
                region.mul_(self._post_default())

        return finalize

    def _unreduce(self) -> None:
        # Every rank holds the whole average: each contributes what reduces back to it.
        self.acc.mul_(1.0 / (self.world * self._post_default()))


class BoundaryReduceScatterSync(_FullAccumulatorSync):
    """Stage 1: reduce-scatter the full accumulator at the boundary; the shard is this rank's row."""

    def held_tensors(self) -> list[torch.Tensor]:
        """The full accumulator and this rank's rows of it."""
        return [self.acc, *self._own]

    def _launch(self, bucket: Bucket) -> Callable[[], None]:
        own = self._own[bucket.index]
        # The accumulator is rewritten from scratch in the next window: the collective may use it.
        pending = C.reduce_scatter_rows(self._wire(bucket), self.group, tag=bucket.index)

        def finalize() -> None:
            row = self._across_replicas(pending.wait())
            if row.data_ptr() != own.data_ptr() or row.dtype != own.dtype:
                own.copy_(row)
            if self._post(1.0) != 1.0:
                own.mul_(self._post(1.0))

        return finalize

    def _unreduce(self) -> None:
        # Only this rank's row is reduced (the collective used the others as workspace): it alone
        # contributes that row, the others nothing.
        for b, own in zip(self.buckets, self._own):
            rows = self._rows(b)
            rows[: self.row].zero_()
            rows[self.row + 1 :].zero_()
            # and each replica of the row a share of it (hybrid sharding all-reduces the replicas)
            own.mul_(1.0 / (self._post(1.0) * self.replicas))


class MicroStepReduceScatterSync(GradSync):
    """Stage 2: reduce-scatter every micro-step; keep only this rank's accumulated shard.

    Full-size gradients live only in a few bucket buffers (:data:`MAX_BUFFERS`), filled by the
    hooks, reused as soon as their collective completes, and freed at the end of backward.
    """

    reduce_as_filled = True
    reduces_every_micro_step = True

    def __init__(self, *args: object, quantized: QuantizedReduction | None = None,
                 spill_dir: Path | None = None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        #: NVMe optimizer offload: the gradient shard lives in a file-backed buffer under this
        #: directory, each bucket's pages taken out of the process once reduced into it
        #: (:class:`~zeroshard.core.host_memory.FileMappedBuffer`)
        self.spill_dir = spill_dir
        self.spills = spill_dir is not None
        self._spill: host_memory.FileMappedBuffer | None = None
        #: bytes of stepped gradients removed from the spill file (:meth:`discard_pages`) so far
        self.discarded_bytes = 0
        #: ZeRO++ qgZ: buckets reduced by quantized all-to-alls, inside nodes then across
        self.quantized = quantized
        self._qgz_blocks: dict[int, int] = {}
        # With optimizer offload the shard lives in host memory (pinned on an accelerator): only
        # this rank's shard crosses over, and it stays allocated (page-locking is slow). On the
        # training device it exists only from a window's first reduction to its step, as FSDP
        # frees gradients after the step: it is not held through the next forward.
        self._pin = (self.acc_device.type == "cpu" and self.device.type != "cpu" and torch.cuda.is_available()
                     and spill_dir is None)
        self._keep = self.acc_device != self.device
        self.acc: torch.Tensor | None = None
        self._acc_views: list[torch.Tensor] = []
        if self._keep:
            self.accumulator()
        self._capacity = max((b.full_numel for b in self.buckets), default=0)
        self._buffers: dict[int, torch.Tensor] = {}  # bucket index -> buffer being filled or reduced
        self._free: list[torch.Tensor] = []
        self._last_pool = 0  # bucket buffers the last backward used
        self._fresh: set[int] = {b.index for b in self.buckets}  # buckets not yet reduced this window

    def _launches_now(self) -> bool:
        return True

    def _buffer(self, bucket: Bucket) -> torch.Tensor:
        buf = self._buffers.get(bucket.index)
        if buf is None:
            # Waiting for the oldest collective frees its buffer; buckets still being filled hold
            # theirs, so when nothing is in flight a new buffer is the only way on.
            while not self._free and self._pending and self._pool_size() >= MAX_BUFFERS:
                self._complete_oldest()
            if self._free:
                buf = self._free.pop()
            else:
                buf = host_memory.empty(self._capacity, self.policy.reduce_dtype, self.device)
            self._buffers[bucket.index] = buf
        return buf[: bucket.full_numel]

    def _write(self, bucket: Bucket, i: int, grad: torch.Tensor, first_in_window: bool) -> None:
        rows = self._buffer(bucket).view(self.layout_world, bucket.numel)
        off, k = bucket.offsets[i], bucket.layouts[i].shard_numel
        scatter_into_rows(rows[:, off : off + k], grad, alpha=self._pre(1.0))

    def _launch(self, bucket: Bucket) -> Callable[[], None]:
        full = self._buffer(bucket)
        self._zero_unwritten(full.view(self.layout_world, bucket.numel), bucket, bucket.ready.__contains__)
        if self.quantized is not None:
            pending = C.ReducedRow(None, self.quantized.reduce_rows(full, self._qgz_block(bucket)))
        else:
            pending = C.reduce_scatter_rows(full, self.group, tag=bucket.index)

        def finalize() -> None:
            row = self._across_replicas(pending.wait())
            # Written (not added) by each bucket's first reduction of a window.
            acc = self.accumulator()[bucket.start : bucket.start + bucket.numel]
            post = self._post(1.0 / self.avg_world)
            if row.device != acc.device:  # offload: the averaged row goes to (page-locked) host memory
                if post != 1.0:
                    row = row.mul(post)
                    post = 1.0
                if bucket.index in self._fresh:
                    self._fresh.discard(bucket.index)
                    acc.copy_(row)  # straight into the pinned shard: no pageable staging copy
                else:
                    acc.add_(row.to(acc.device))
                self._free.append(self._buffers.pop(bucket.index))
                self.release_pages(acc)
                return
            if bucket.index in self._fresh:
                self._fresh.discard(bucket.index)
                torch.mul(row, post, out=acc)
            else:
                acc.add_(row, alpha=post)
            self._free.append(self._buffers.pop(bucket.index))
            self.release_pages(acc)

        return finalize

    def held_tensors(self) -> list[torch.Tensor]:
        """The shard accumulator and its per-bucket views, while it exists."""
        return [self.acc, *self._acc_views] if self.acc is not None else []

    def release_pages(self, t: torch.Tensor) -> None:
        """Take the pages of ``t`` (a view of the gradient shard) out of the process, when spilled; a
        shard moved elsewhere (``engine.offload_states``) or a copy of ``t`` (a cast to fp32) is no
        file-backed buffer and is left alone."""
        if self.spills:
            host_memory.drop_file_pages(t)

    def discard_pages(self, t: torch.Tensor) -> None:
        """Throw away ``t`` (a view of the spilled gradient shard, stepped): whole pages are removed
        from the file (``MADV_REMOVE``), not written back; partial pages at its ends only dropped.
        Also after :meth:`zero` (ZeRO-3 steps sub-groups during the next forward): ``t`` keeps the
        mapping; as in :meth:`release_pages`, what is not file-backed is left alone."""
        if self.spills:
            self.discarded_bytes += host_memory.discard_file_pages(t)

    def _qgz_block(self, bucket: Bucket) -> int:
        block = self._qgz_blocks.get(bucket.index)
        if block is None:
            shapes = [full_shape(p) for p in bucket.params]
            block = self._qgz_blocks[bucket.index] = qgz_bucket_block_size(shapes, self.world)
        return block

    def accumulator(self) -> torch.Tensor:
        """This rank's flat gradient shard, allocated if the window has none yet."""
        if self.acc is None:
            if self.spill_dir is not None:
                self._spill = host_memory.FileMappedBuffer(
                    self.spill_dir, self.shard_numel * self.policy.grad_accum_dtype.itemsize)
                self.acc = self._spill.tensor(self.policy.grad_accum_dtype)
            elif self._pin:
                self.acc = torch.empty(self.shard_numel, dtype=self.policy.grad_accum_dtype, device=self.acc_device,
                                       pin_memory=True)
            else:  # freed at each step: on CPU, outside the heap (see host_memory)
                self.acc = host_memory.empty(self.shard_numel, self.policy.grad_accum_dtype, self.acc_device)
            self._acc_views = [self.acc[b.start : b.start + b.numel] for b in self.buckets]
        return self.acc

    def shard_grads(self) -> list[torch.Tensor]:
        self.accumulator()
        for i in self._fresh:  # not reduced in this window (no backward at all): no gradient
            self._acc_views[i].zero_()
        return self._acc_views

    def finish_backward(self) -> None:
        """Complete the reductions, then free the bucket buffers: nothing needs them until the
        next backward, and the optimizer step and the next forward can use their memory (on CPU
        their mappings go back to the system)."""
        super().finish_backward()
        self._last_pool = self._pool_size()
        self._free.clear()

    def zero(self) -> None:
        super().zero()
        self._fresh = {b.index for b in self.buckets}
        if not self._keep or self._spill is not None:  # consumed: freed until the next window's first reduction
            self.acc = None
            self._acc_views = []
            self._spill = None

    def _pool_size(self) -> int:
        """Bucket buffers allocated: every one is either free or held by a bucket."""
        return len(self._free) + len(self._buffers)

    def bytes_held(self) -> int:
        """Bytes of the gradient shard while it exists (from a window's first reduction to its step);
        spilled, none in memory (:meth:`spilled_bytes`)."""
        return 0 if self.spills else self.shard_numel * self.policy.grad_accum_dtype.itemsize

    def spilled_bytes(self) -> int:
        """Bytes of the gradient shard in its file-backed buffer (0 unless spilled)."""
        return self.shard_numel * self.policy.grad_accum_dtype.itemsize if self.spills else 0

    def workspace_bytes(self) -> int:
        """Bytes of the bucket buffers in the last backward (freed at its end)."""
        return max(self._pool_size(), self._last_pool) * self._capacity * self.policy.reduce_dtype.itemsize
