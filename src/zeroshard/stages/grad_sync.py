"""Gradient synchronisation: from autograd hooks to reduced, averaged gradient shards.

Design note
-----------
A post-accumulate-grad hook on every trained parameter moves ``p.grad`` into a bucket buffer
(laid out ``[world, bucket.numel]``, see :mod:`zeroshard.partition.layout`) and frees it, so the
module never holds its own ``.grad``. Buckets launch strictly in index order (a bucket goes out
once it and every earlier bucket are complete), so ranks issue identical collective sequences even
when data-dependent control flow leaves different parameters unused; whatever is still pending
launches when backward returns. With ``overlap_comm`` a bucket's collective runs while autograd
computes the remaining gradients.

Three strategies, one per stage:

- :class:`AllReduceSync` (stage 0): full-size accumulator, all-reduced at the accumulation
  boundary. Every rank ends up with the whole averaged gradient.
- :class:`BoundaryReduceScatterSync` (stage 1): full-size accumulator, reduce-scattered at the
  boundary, so each rank keeps only its shard for the optimizer step.
- :class:`MicroStepReduceScatterSync` (stage 2): every micro-step's gradients are reduce-scattered
  as buckets fill and added to a persistent accumulator of this rank's shard only; full-size
  gradients exist only transiently, bucket by bucket.

Gradients are averaged over ranks after the collective (``sum / world``) and accumulated in the
policy's ``grad_accum_dtype`` (fp32 by default).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from zeroshard.comm import collectives as C
from zeroshard.partition import Bucket, scatter_into_rows
from zeroshard.precision import PrecisionPolicy

_Pending = tuple[Bucket, "dist.Work | None", Callable[[], None]]


class GradSync:
    """Base class: hook bookkeeping and in-order bucket launching."""

    def __init__(self, buckets: list[Bucket], group: dist.ProcessGroup | None, policy: PrecisionPolicy,
                 device: torch.device, overlap_comm: bool) -> None:
        #: Launch strictly in bucket order (stages 0-2). ZeRO-3 launches each unit as it completes:
        #: its all-gathers already require every rank to run modules in the same order.
        self.ordered = True
        #: Called with a bucket once all its gradients have been written (ZeRO-3 releases the unit).
        self.on_complete: Callable[[Bucket], None] | None = None
        self.buckets = buckets
        self.group = group
        self.world = C.world_size(group)
        self.policy = policy
        self.device = device
        self.overlap_comm = overlap_comm
        self.layout_world = buckets[0].layouts[0].world if buckets and buckets[0].layouts else 1
        self.shard_numel = sum(b.numel for b in buckets)
        self._where: dict[torch.nn.Parameter, tuple[Bucket, int]] = {
            p: (b, i) for b in buckets for i, p in enumerate(b.params)
        }
        self._params = list(self._where)
        self._index = {p: k for k, p in enumerate(self._params)}
        self._seen: set[int] = set()  # parameters that received a gradient in this window
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._pending: list[_Pending] = []
        self._launched: set[int] = set()
        self._next_launch = 0
        self.boundary = True
        for p in self._where:
            self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    # -- hooks -------------------------------------------------------------------------------
    def start_backward(self, boundary: bool) -> None:
        """Called before ``loss.backward()``: whether this micro-step ends the accumulation window."""
        self.boundary = boundary
        self._next_launch = 0
        self._launched.clear()
        for b in self.buckets:
            b.ready.clear()

    def _on_grad(self, p: torch.Tensor) -> None:
        bucket, i = self._where[p]  # type: ignore[index]
        grad = p.grad
        if grad is None:
            return
        self._write(bucket, i, grad.detach().reshape(-1))
        p.grad = None
        self._seen.add(self._index[p])  # type: ignore[index]
        bucket.ready.add(i)
        complete = len(bucket.ready) == len(bucket.params)
        if complete and self.on_complete is not None:
            self.on_complete(bucket)
        if not (self.overlap_comm and self._launches_now()):
            return
        if self.ordered:
            self._launch_ready()
        elif complete:
            self._launch_bucket(bucket)

    def finish_backward(self) -> None:
        """Called after ``loss.backward()``: launch what is left, in order, and wait for all of it."""
        if self._launches_now():
            for b in self.buckets:
                self._launch_bucket(b)
        for _bucket, work, finalize in self._pending:
            if work is not None:
                work.wait()
            finalize()
        self._pending.clear()

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
        work, finalize = self._launch(b)
        self._pending.append((b, work, finalize))

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

    # -- strategy ----------------------------------------------------------------------------
    def _launches_now(self) -> bool:
        """Whether collectives are issued in this micro-step."""
        return self.boundary

    def _write(self, bucket: Bucket, i: int, grad: torch.Tensor) -> None:
        raise NotImplementedError

    def _launch(self, bucket: Bucket) -> tuple[dist.Work | None, Callable[[], None]]:
        raise NotImplementedError

    def shard_grads(self) -> torch.Tensor:
        """This rank's averaged gradient shard, flat (``shard_numel`` elements), after the boundary."""
        raise NotImplementedError

    def zero(self) -> None:
        """Forget accumulated gradients (after a step, or a skipped one)."""
        self._seen.clear()

    def bytes_held(self) -> int:
        """Bytes of gradient state that persist between steps on this rank."""
        raise NotImplementedError


class _FullAccumulatorSync(GradSync):
    """Stages 0 and 1: accumulate full gradients locally; communicate only at the boundary."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.acc = torch.zeros(self.layout_world * self.shard_numel, dtype=self.policy.grad_accum_dtype,
                               device=self.device)

    def _rows(self, bucket: Bucket) -> torch.Tensor:
        a = self.layout_world * bucket.start
        return self.acc[a : a + bucket.full_numel].view(self.layout_world, bucket.numel)

    def _write(self, bucket: Bucket, i: int, grad: torch.Tensor) -> None:
        off, k = bucket.offsets[i], bucket.layouts[i].shard_numel
        scatter_into_rows(self._rows(bucket)[:, off : off + k], grad, accumulate=True)

    def zero(self) -> None:
        super().zero()
        self.acc.zero_()

    def bytes_held(self) -> int:
        return self.acc.numel() * self.acc.element_size()


class AllReduceSync(_FullAccumulatorSync):
    """Stage 0: all-reduce the full accumulator bucket by bucket; every rank keeps everything."""

    def _launch(self, bucket: Bucket) -> tuple[dist.Work | None, Callable[[], None]]:
        region = self._rows(bucket).view(-1)
        wire = region if region.dtype == self.policy.reduce_dtype else region.to(self.policy.reduce_dtype)
        work = C.all_reduce(wire, self.group)

        def finalize() -> None:
            if wire is not region:
                region.copy_(wire)
            region.div_(self.world)

        return work, finalize

    def shard_grads(self) -> torch.Tensor:
        return self.acc


class BoundaryReduceScatterSync(_FullAccumulatorSync):
    """Stage 1: reduce-scatter the full accumulator at the boundary into a transient shard."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._shard: torch.Tensor | None = None

    def _launch(self, bucket: Bucket) -> tuple[dist.Work | None, Callable[[], None]]:
        if self._shard is None:
            self._shard = torch.empty(self.shard_numel, dtype=self.policy.grad_accum_dtype, device=self.device)
        out = self._shard[bucket.start : bucket.start + bucket.numel]
        region = self._rows(bucket).view(-1)
        rd = self.policy.reduce_dtype
        wire_in = region if region.dtype == rd else region.to(rd)
        wire_out = out if out.dtype == rd else torch.empty(bucket.numel, dtype=rd, device=self.device)
        # The accumulator region is zeroed after the step, so the collective may use it as scratch.
        work = C.reduce_scatter(wire_out, wire_in, self.group, scratch_input=True)

        def finalize() -> None:
            if wire_out is not out:
                out.copy_(wire_out)
            out.div_(self.world)

        return work, finalize

    def shard_grads(self) -> torch.Tensor:
        assert self._shard is not None, "shard_grads() before the boundary backward"
        return self._shard

    def zero(self) -> None:
        super().zero()
        self._shard = None


class MicroStepReduceScatterSync(GradSync):
    """Stage 2: reduce-scatter every micro-step; keep only this rank's accumulated shard."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.acc = torch.zeros(self.shard_numel, dtype=self.policy.grad_accum_dtype, device=self.device)
        self._buffers: dict[int, torch.Tensor] = {}

    def _launches_now(self) -> bool:
        return True

    def _buffer(self, bucket: Bucket) -> torch.Tensor:
        buf = self._buffers.get(bucket.index)
        if buf is None:
            buf = torch.zeros(bucket.full_numel, dtype=self.policy.reduce_dtype, device=self.device)
            self._buffers[bucket.index] = buf
        return buf

    def _write(self, bucket: Bucket, i: int, grad: torch.Tensor) -> None:
        rows = self._buffer(bucket).view(self.layout_world, bucket.numel)
        off, k = bucket.offsets[i], bucket.layouts[i].shard_numel
        scatter_into_rows(rows[:, off : off + k], grad)

    def _launch(self, bucket: Bucket) -> tuple[dist.Work | None, Callable[[], None]]:
        full = self._buffer(bucket)
        out = torch.empty(bucket.numel, dtype=self.policy.reduce_dtype, device=self.device)
        work = C.reduce_scatter(out, full, self.group, scratch_input=True)  # the buffer is dropped after
        acc = self.acc[bucket.start : bucket.start + bucket.numel]

        def finalize() -> None:
            acc.add_(out, alpha=1.0 / self.world)
            # The full-size buffer lives only until its collective completes.
            self._buffers.pop(bucket.index, None)

        return work, finalize

    def shard_grads(self) -> torch.Tensor:
        return self.acc

    def zero(self) -> None:
        super().zero()
        self.acc.zero_()

    def bytes_held(self) -> int:
        return self.acc.numel() * self.acc.element_size()
