"""Where ZeRO-3's compute-dtype parameter shard lives: device memory, host memory or a file.

Stage 3 keeps each rank's chunk of every unit in a flat shard with the master layout (see
:mod:`zeroshard.core.zero3.stage3`). :func:`make_param_shard` places it by the offload policy:

- ``offload_param: none``: on the training device. With masters on the device too it *is* the
  master buffer: units are gathered from the fp32 masters, cast to the compute dtype chunk by
  chunk, and no compute-dtype copy of the shard is kept (2 bytes per parameter over N saved).
  Masters split between the device and host memory (partial optimizer offload) are two buffers:
  the shard is a copy of its own.
- ``offload_param: cpu``: in host memory (pinned with an accelerator); each unit's chunk is copied
  to the device inside its all-gather, which the coordinator prefetches. With fp32 compute and
  host masters (``offload_optimizer: cpu``) it is the master buffer.
- ``offload_param: nvme``: in a swap file, one aligned region per unit, read into a pooled host
  buffer when the unit is gathered (the read starts when the prefetch does).

After each optimizer sub-group the state store publishes the updated masters here (a cast copy,
or unit-by-unit writes to the file).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from zeroshard.core.offload.aio import (
    AsyncIO,
    IOHandle,
    SwapFile,
    check_free_space,
    release_when_collected,
    swap_dir,
)
from zeroshard.core.offload.buffers import BufferPool
from zeroshard.core.offload.policy import OffloadPolicy, Residency, host_device, place_of, should_pin
from zeroshard.core.offload.swap_files import round_up
from zeroshard.core.partition import Bucket
from zeroshard.errors import ConfigError

if TYPE_CHECKING:
    from zeroshard.core.master import MasterShard

__all__ = ["ParamShard", "ParamSwapFile", "PendingRead", "make_param_shard", "place_shard"]


class PendingRead:
    """A unit's chunk being read from the swap file into a pooled buffer."""

    def __init__(self, handle: IOHandle, buf: torch.Tensor, numel: int, pool: BufferPool) -> None:
        self._handle, self._buf, self._numel, self._pool = handle, buf, numel, pool

    def wait(self) -> torch.Tensor:
        """The chunk (a view of the buffer, valid until :meth:`release`)."""
        self._handle.wait()
        return self._buf[: self._numel]

    def release(self) -> None:
        """Return the buffer to the pool."""
        self._pool.release(self._buf)


class ParamSwapFile:
    """The rank's parameter shard in one swap file, each unit at an aligned offset."""

    def __init__(self, buckets: list[Bucket], dtype: torch.dtype, policy: OffloadPolicy, rank: int,
                 pin: bool, clock: Callable[[], int] | None = None) -> None:
        assert policy.param_nvme_path is not None
        self.dtype = dtype
        self.offsets: dict[int, int] = {}
        pos = 0
        for b in buckets:
            self.offsets[b.index] = pos
            pos = round_up(pos + b.numel * dtype.itemsize)
        largest = max((b.numel for b in buckets), default=0)
        if largest > policy.param_buffer_size:
            raise ConfigError(f"a ZeRO-3 unit has {largest:,} elements, more than the parameter swap buffers "
                              f"hold ({policy.param_buffer_size:,}); raise buffer_size to at least {largest}",
                              key="zero_optimization.offload_param.buffer_size")
        check_free_space(policy.param_nvme_path, pos, "zero_optimization.offload_param.nvme_path")
        self.directory = swap_dir(policy.param_nvme_path, rank)
        self.file = SwapFile(self.directory / "params.swp", max(pos, 4096))
        a = policy.aio
        self.io = AsyncIO(a.block_size, a.queue_depth, a.threads)
        self._release = release_when_collected(self, self.io, [self.file], self.directory)
        self.numel = {b.index: b.numel for b in buckets}
        self.pool = BufferPool(policy.param_buffer_count, max(largest, 1), dtype, pin)
        #: the engine's step counter, for error messages
        self.step = clock
        #: parameter writes in flight, oldest first, with their pool buffers
        self._writes: list[tuple[IOHandle, torch.Tensor]] = []

    def read(self, index: int) -> PendingRead:
        """Start reading unit ``index``'s chunk (after any write still in flight)."""
        if self._writes:
            self.flush()
        buf = self.pool.acquire()
        n = self.numel[index]
        handle = self.io.read(self.file, self.offsets[index], buf[:n], what=self._what(index))
        return PendingRead(handle, buf, n, self.pool)

    def write(self, index: int, values: torch.Tensor) -> None:
        """Start overwriting unit ``index``'s chunk (``values``: its ``bucket.numel`` elements, any
        dtype and device; cast on the way). The write proceeds while the optimizer steps the next
        sub-group; at most the pool's buffers are in flight (the oldest is waited for beyond
        that), and :meth:`flush` (before the chunk is read again) waits for the rest."""
        while self._writes and self.pool.exhausted:
            self._finish_oldest_write()
        buf = self.pool.acquire()
        n = self.numel[index]
        try:
            buf[:n].copy_(values)
            self._writes.append((self.io.write(self.file, self.offsets[index], buf[:n], what=self._what(index)), buf))
        except BaseException:
            self.pool.release(buf)
            raise

    def _finish_oldest_write(self) -> None:
        handle, buf = self._writes.pop(0)
        try:
            handle.wait()
        finally:
            self.pool.release(buf)

    def flush(self) -> None:
        """Wait for every write in flight (an I/O error surfaces here, naming the file and step)."""
        while self._writes:
            self._finish_oldest_write()

    def _what(self, index: int) -> str:
        return f"ZeRO-3 parameter shard of unit {index}" + (f", step {self.step()}" if self.step is not None else "")

    @property
    def file_bytes(self) -> int:
        """Bytes of the swap file."""
        return self.file.nbytes

    def close(self) -> None:
        """Stop the I/O threads and remove the swap file."""
        while self._writes:
            try:
                self._finish_oldest_write()
            except OSError:
                pass  # the file is being removed: a failed write of it no longer matters
        self._release()


class ParamShard:
    """The compute-dtype parameter shard: a flat tensor in memory, or a swap file."""

    def __init__(self, buckets: list[Bucket], flat: torch.Tensor | None, swap: ParamSwapFile | None,
                 aliased: bool) -> None:
        self.buckets = buckets
        self.flat = flat
        self.swap = swap
        #: the shard is the master buffer itself: nothing to publish after a step
        self.aliased = aliased

    def unit_view(self, b: Bucket) -> torch.Tensor | None:
        """Unit ``b``'s chunk in memory (``None`` when it lives in the file)."""
        return None if self.flat is None else self.flat[b.start : b.start + b.numel]

    def publish(self, start: int, end: int, values: torch.Tensor) -> None:
        """Take the updated fp32 masters of the flat range ``[start, end)`` (whole units)."""
        if self.flat is not None:
            # Asynchronous from page-locked masters (overlaps the next sub-group's step); the swapped
            # store waits for the stream before it refills a buffer that was published from.
            self.flat[start:end].copy_(values, non_blocking=True)
            return
        assert self.swap is not None
        for b in self.buckets:
            if start <= b.start < end:
                self.swap.write(b.index, values[b.start - start : b.start - start + b.numel])

    def bytes_held(self) -> dict[str, int]:
        """Bytes by place (``device``, ``host``, ``pinned_host``, ``file``); 0 when aliased."""
        if self.aliased:
            return {}
        if self.swap is not None:
            buffers = "pinned_host" if self.swap.pool.pin else "host"
            return {"file": self.swap.file_bytes, buffers: self.swap.pool.nbytes}
        assert self.flat is not None
        return {place_of(self.flat): self.flat.numel() * self.flat.element_size()}

    def flush(self) -> None:
        """Wait for parameter writes in flight (after an optimizer step publishes)."""
        if self.swap is not None:
            self.swap.flush()

    def close(self) -> None:
        """Remove the swap file, if any."""
        if self.swap is not None:
            self.swap.close()


def make_param_shard(master: MasterShard, buckets: list[Bucket], policy: OffloadPolicy, dtype: torch.dtype,
                     device: torch.device, rank: int, clock: Callable[[], int] | None = None) -> ParamShard:
    """Place the parameter shard of ``buckets`` (the master layout) by ``policy.params``."""
    res = policy.params
    where = device if res is Residency.DEVICE else host_device()
    if res is not Residency.FILE and not master.swapped and master.kept is None and master.flat.device == where and (
            dtype == torch.float32 or where.type == device.type):
        # The masters are where the parameters are gathered: gather from them, casting each unit's
        # chunk on the way (as FSDP2 does), rather than keep a compute-dtype copy of the shard.
        return ParamShard(buckets, master.flat, None, aliased=True)

    def row(b: Bucket) -> torch.Tensor:
        return master.span(b.start, b.start + b.numel) if not master.swapped else _initial_row(master, b)

    return place_shard(buckets, master.numel, policy, dtype, device, rank, row, clock)


def place_shard(buckets: list[Bucket], numel: int, policy: OffloadPolicy, dtype: torch.dtype,
                device: torch.device, rank: int, row: Callable[[Bucket], torch.Tensor],
                clock: Callable[[], int] | None = None) -> ParamShard:
    """A shard of its own (not the masters) for ``buckets`` (``numel`` elements back to back),
    where ``policy.params`` says, filled with ``row(b)`` (bucket ``b``'s row, any dtype and device)."""
    res = policy.params
    where = device if res is Residency.DEVICE else host_device()
    pin = should_pin(policy.param_pin_memory, device)
    if res is Residency.FILE:
        swap = ParamSwapFile(buckets, dtype, policy, rank, pin, clock)
        try:
            for b in buckets:
                swap.write(b.index, row(b))
            swap.flush()
        except BaseException:
            swap.close()
            raise
        return ParamShard(buckets, None, swap, aliased=False)
    flat = torch.empty(numel, dtype=dtype, device=where, pin_memory=pin and where.type == "cpu")
    for b in buckets:
        flat[b.start : b.start + b.numel].copy_(row(b))
    return ParamShard(buckets, flat, None, aliased=False)


def _initial_row(master: MasterShard, b: Bucket) -> torch.Tensor:
    """Bucket ``b``'s row of initial fp32 values (padding zero), from the parameters themselves."""
    row = torch.zeros(b.numel, dtype=torch.float32)
    for p, off in zip(b.params, b.offsets):
        n = master.ranges[p][1] - master.ranges[p][0]
        master.copy_initial(p, row[off : off + n])
    return row
