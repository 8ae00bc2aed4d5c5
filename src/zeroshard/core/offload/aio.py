"""Asynchronous reads and writes of tensor bytes at swap-file offsets: the NVMe offload I/O engine.

Pure Python over ``os.preadv`` / ``os.pwrite`` in a thread pool: nothing to compile, and the GIL is
released during each system call, so transfers overlap with the optimizer step and with compute.
The swap files and buffers it works on come from :mod:`zeroshard.core.offload.swap_files` (re-exported
here).

How a request runs. ``read``/``write`` split the tensor's bytes into chunks of ``block_size`` and
return an :class:`IOHandle` at once. At most ``queue_depth`` chunks of one request are queued in
the pool at a time (each finished chunk queues the next), so concurrent requests interleave instead
of one large request starving the others; ``threads`` workers run them, queued read chunks
before queued write chunks. A read is what the training thread is about to wait for (the next
sub-group to step, a unit to gather); a write is write-behind, so a write queued ahead must not
delay it (ordering that matters is stated with ``after``, never left to queue position). An error stops the
request's remaining chunks and is raised by :meth:`IOHandle.wait` as
:class:`~zeroshard.errors.OffloadIOError`, naming the file, the offset, the byte count, the
caller's ``what`` and the OS error. A read that reaches the end of the file early is an error too.
A request may be made to start only ``after`` others have ended: it is queued by the worker that
ends the last of them, so a caller can issue a buffer's next read right behind the write still
reading from it and go on, instead of waiting for the write itself.

``O_DIRECT`` files (``SwapFile.direct``) need aligned memory, offsets and lengths. Offsets must be
multiples of :data:`ALIGNMENT` (checked, in both modes, so that code tested on one filesystem works
on another). A chunk whose memory is aligned (tensors from :func:`aligned_empty`) goes straight
between the tensor and the file, except its last ``len % 4096`` bytes; those, and whole chunks of
unaligned tensors, go through a per-thread aligned bounce buffer, padded with zeros to a whole
block on writes (the file is sized in whole blocks, so the padding stays inside it). Buffered files
transfer straight from the tensor, then drop the pages from the page cache
(``posix_fadvise(DONTNEED)``) so that swapping does not fill host memory with cached file pages.

DeepSpeed's ``aio`` keys map to the constructor: ``block_size`` (1 MiB), ``queue_depth`` (8),
``intra_op_parallelism`` (formerly ``thread_count``; 1) -> ``threads``. ``single_submit`` and
``overlap_events`` describe libaio submission and have no counterpart here.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType

import torch

from zeroshard.core.offload.swap_files import (
    ALIGNMENT,
    SwapFile,
    aligned_empty,
    byte_view,
    check_free_space,
    remove_swap_dir,
    round_up,
    swap_dir,
)
from zeroshard.errors import ConfigError, OffloadIOError

__all__ = [
    "ALIGNMENT",
    "AsyncIO",
    "IOHandle",
    "OffloadIOError",
    "SwapFile",
    "aligned_empty",
    "check_free_space",
    "release",
    "release_when_collected",
    "remove_swap_dir",
    "swap_dir",
]

_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None)


class _ShortTransfer(Exception):
    """A system call moved fewer bytes than asked and then none: the end of the file."""


class IOHandle:
    """One pending read or write; :meth:`wait` for it before touching its tensor."""

    def __init__(self, engine: AsyncIO, op: str, file: SwapFile, offset: int, data: torch.Tensor, what: str) -> None:
        self.op, self.file, self.offset, self.what = op, file, offset, what
        self._engine = engine
        self._u8 = data  # the tensor's bytes, a flat uint8 view: kept alive until the transfer ends
        self._view = byte_view(data) if data.numel() else memoryview(b"")
        self._addr = data.data_ptr()
        n = data.numel()
        bs = engine.block_size
        self._chunks = [(s, min(s + bs, n)) for s in range(0, n, bs)]
        self._next = 0
        self._in_flight = 0
        self._error: BaseException | None = None
        self._error_at = offset
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._callbacks: list[Callable[[], None]] = []
        if not self._chunks:
            self._done.set()

    @property
    def nbytes(self) -> int:
        """Bytes this request moves."""
        return self._u8.numel()

    def done(self) -> bool:
        """Whether every chunk has finished (or the request has stopped on an error)."""
        return self._done.is_set()

    def wait(self) -> None:
        """Block until the transfer has finished.

        Raises:
            OffloadIOError: the transfer failed or a read ended early; the message names the file,
                the offset, the byte count, ``what`` and the cause.
        """
        self._done.wait()
        err = self._error
        if err is None:
            return
        if isinstance(err, _ShortTransfer):
            cause, code = f"short {self.op}: {err} (the file is {_size_of(self.file)})", None
        elif isinstance(err, OSError):
            cause, code = str(err), err.errno
        else:
            cause, code = f"{type(err).__name__}: {err}", None
        label = f" ({self.what})" if self.what else ""
        raise OffloadIOError(
            f"{self.op} of {self.nbytes} bytes at offset {self.offset} of swap file {self.file.path}{label} "
            f"failed at file offset {self._error_at}: {cause}",
            str(self.file.path),
            code,
        ) from err

    def _on_done(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (in whichever thread ends the request) once the request is done, or now."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def _take(self) -> list[int]:
        """Chunk indices to queue now, within ``queue_depth``; none once an error stopped the request."""
        with self._lock:
            take: list[int] = []
            while self._error is None and self._next < len(self._chunks):
                if self._in_flight >= self._engine.queue_depth:
                    break
                take.append(self._next)
                self._next += 1
                self._in_flight += 1
            return take

    def _finish(self, index: int, error: BaseException | None) -> None:
        with self._lock:
            self._in_flight -= 1
            if error is not None and self._error is None:
                self._error, self._error_at = error, self.offset + self._chunks[index][0]
            if self._in_flight == 0 and (self._error is not None or self._next == len(self._chunks)):
                self._done.set()
            callbacks: list[Callable[[], None]] = []
            if self._done.is_set():
                callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()


class AsyncIO:
    """A thread pool that reads and writes tensor bytes at swap-file offsets.

    Args:
        block_size: bytes per chunk, a positive multiple of :data:`ALIGNMENT` (``aio.block_size``).
        queue_depth: chunks of one request queued at a time (``aio.queue_depth``).
        threads: worker threads (``aio.intra_op_parallelism``).

    Attributes:
        bytes_read: bytes delivered into tensors by finished read chunks, since construction.
        bytes_read_requested: bytes of the read requests submitted, since construction (what was
            asked for when, whatever the disk's speed).
        bytes_written: bytes of tensors written by finished write chunks (padding not counted).
        busy_seconds: wall time during which at least one transfer was running, since
            construction: with the byte counters, the bandwidth the disk delivered to this engine
            while training (benchmarks compare a step with it).

    Raises:
        ConfigError: naming the ``aio`` key of a value out of range.
    """

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 8, threads: int = 1) -> None:
        if block_size <= 0 or block_size % ALIGNMENT:
            raise ConfigError(
                f"must be a positive multiple of {ALIGNMENT} bytes, got {block_size}", key="aio.block_size"
            )
        if queue_depth < 1:
            raise ConfigError(f"must be at least 1, got {queue_depth}", key="aio.queue_depth")
        if threads < 1:
            raise ConfigError(f"must be at least 1, got {threads}", key="aio.intra_op_parallelism")
        self.block_size, self.queue_depth, self.threads = block_size, queue_depth, threads
        self.bytes_read = 0
        self.bytes_read_requested = 0
        self.bytes_written = 0
        self.busy_seconds = 0.0
        self._running = 0
        self._busy_since = 0.0
        self._local = threading.local()
        self._lock = threading.Lock()
        self._pending: set[IOHandle] = set()
        self._closed = False
        #: queued chunks, reads and writes apart: a worker takes a read first
        self._queued: dict[str, deque[tuple[IOHandle, int]]] = {"read": deque(), "write": deque()}
        self._work = threading.Condition()
        self._stopping = False
        # Daemon threads: an engine never closed must not keep the interpreter from exiting.
        self._workers = [threading.Thread(target=self._worker, name=f"zeroshard-aio-{i}", daemon=True)
                         for i in range(threads)]
        for w in self._workers:
            w.start()

    def read(self, file: SwapFile, offset: int, out: torch.Tensor, *, what: str = "",
             after: Sequence[IOHandle] = ()) -> IOHandle:
        """Start filling the contiguous CPU tensor ``out`` from bytes ``[offset, offset + out.nbytes)``
        of ``file``, once every request in ``after`` has ended (successfully or not: their errors
        stay with their own handles)."""
        self.bytes_read_requested += out.numel() * out.element_size()
        return self._submit("read", file, offset, out, what, after)

    def write(self, file: SwapFile, offset: int, src: torch.Tensor, *, what: str = "",
              after: Sequence[IOHandle] = ()) -> IOHandle:
        """Start writing the bytes of the contiguous CPU tensor ``src`` to ``file`` at ``offset``,
        once every request in ``after`` has ended."""
        return self._submit("write", file, offset, src, what, after)

    def close(self) -> None:
        """Wait for every pending request (their errors stay with their handles), then stop the threads."""
        with self._lock:
            self._closed = True
            pending = list(self._pending)
        for h in pending:
            h._done.wait()
        with self._work:
            self._stopping = True
            self._work.notify_all()
        for w in self._workers:
            w.join()

    def _in_worker(self) -> bool:
        return threading.current_thread() in self._workers

    def __enter__(self) -> AsyncIO:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _submit(self, op: str, file: SwapFile, offset: int, t: torch.Tensor, what: str,
                after: Sequence[IOHandle]) -> IOHandle:
        label = f" ({what})" if what else ""
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{op}{label}: needs a contiguous CPU tensor, got device {t.device}, "
                             f"contiguous={t.is_contiguous()}")
        u8 = t.detach().reshape(-1).view(torch.uint8)
        end = offset + u8.numel()
        if offset < 0 or offset % ALIGNMENT or end > file.nbytes:
            raise OffloadIOError(
                f"{op} of {u8.numel()} bytes at offset {offset} of swap file {file.path}{label}: the offset must be "
                f"a multiple of {ALIGNMENT} and the range within the file's {file.nbytes} bytes",
                str(file.path),
            )
        file.fileno()  # a closed file fails here, in the caller, not in a worker
        handle = IOHandle(self, op, file, offset, u8, what)
        with self._lock:
            if self._closed:
                raise OffloadIOError(
                    f"{op}{label} on swap file {file.path}: the AsyncIO engine is closed", str(file.path)
                )
            if not handle.done():
                self._pending.add(handle)
        waiting = [h for h in after if not h.done()]
        if not waiting:
            self._queue(handle)
            return handle
        # Queued by whichever of them ends last, in its worker thread: the caller does not wait
        # (a buffer's next read can be issued right behind the write that still reads it).
        left = [len(waiting)]
        lock = threading.Lock()

        def one_ended() -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._queue(handle)

        for h in waiting:
            h._on_done(one_ended)
        return handle

    def _queue(self, handle: IOHandle) -> None:
        take = handle._take()
        if take:
            with self._work:
                self._queued[handle.op].extend((handle, i) for i in take)
                self._work.notify(len(take))

    def _worker(self) -> None:
        reads, writes = self._queued["read"], self._queued["write"]
        while True:
            with self._work:
                while not reads and not writes and not self._stopping:
                    self._work.wait()
                if not reads and not writes:
                    return
                handle, index = reads.popleft() if reads else writes.popleft()
            self._busy(+1)
            try:
                self._run(handle, index)
            finally:
                self._busy(-1)

    def _busy(self, change: int) -> None:
        now = time.perf_counter()
        with self._lock:
            if change > 0 and self._running == 0:
                self._busy_since = now
            self._running += change
            if self._running == 0:
                self.busy_seconds += now - self._busy_since

    def _run(self, handle: IOHandle, index: int) -> None:
        start, end = handle._chunks[index]
        error: BaseException | None = None
        try:
            self._transfer(handle, start, end)
        except BaseException as e:  # surfaced by IOHandle.wait(); a worker must never swallow one
            error = e
        else:
            with self._lock:
                if handle.op == "read":
                    self.bytes_read += end - start
                else:
                    self.bytes_written += end - start
        handle._finish(index, error)
        if handle.done():
            with self._lock:
                self._pending.discard(handle)
        else:
            self._queue(handle)

    def _transfer(self, h: IOHandle, start: int, end: int) -> None:
        fd, pos, n = h.file.fileno(), h.offset + start, end - start
        if not h.file.direct:
            _move(h.op, fd, h._view[start:end], pos, n)
            if _DONTNEED is not None:
                os.posix_fadvise(fd, pos, n, _DONTNEED)
            return
        # O_DIRECT: the aligned whole blocks straight from the tensor, the rest through the bounce buffer.
        whole = n - n % ALIGNMENT if (h._addr + start) % ALIGNMENT == 0 else 0
        if whole:
            _move(h.op, fd, h._view[start : start + whole], pos, whole)
        if whole < n:
            self._bounce(h, fd, start + whole, end, pos + whole)

    def _bounce(self, h: IOHandle, fd: int, start: int, end: int, pos: int) -> None:
        buf: torch.Tensor | None = getattr(self._local, "bounce", None)
        if buf is None:
            buf = self._local.bounce = aligned_empty(self.block_size, torch.uint8)
        n = end - start
        padded = round_up(n)
        view = byte_view(buf)[:padded]
        if h.op == "write":
            buf[:n].copy_(h._u8[start:end])
            buf[n:padded].zero_()
            _move("write", fd, view, pos, padded)
        else:
            _move("read", fd, view, pos, n)  # the padding past the file's end may come back short
            h._u8[start:end].copy_(buf[:n])


def release(io: AsyncIO, files: Iterable[SwapFile], directory: Path, owner_pid: int) -> None:
    """Stop ``io``'s threads once its requests have ended, close and delete ``files`` (iterated now)
    and remove ``directory``: the end of a swap store's ``close()``, and what a store collected
    without it (its engine dropped without ``destroy()``) gets from its finalizer, so that a sweep of
    trainings in one process does not pile up threads, descriptors and swap files.

    Only in the process that made them (``owner_pid``): a forked child inherits the store, not its
    I/O threads or its files. A finalizer may run in one of ``io``'s own workers (a collection
    there): that worker cannot wait for itself, so the release then runs in a thread of its own.
    """
    if os.getpid() != owner_pid:
        return
    if io._in_worker():
        threading.Thread(target=release, args=(io, list(files), directory, owner_pid),
                         name="zeroshard-aio-release", daemon=True).start()
        return
    io.close()
    for f in list(files):
        f.close(remove=True)
    remove_swap_dir(directory)


def release_when_collected(store: object, io: AsyncIO, files: Iterable[SwapFile],
                           directory: Path) -> weakref.finalize[..., object]:
    """A finalizer that runs :func:`release` on a swap store's resources once ``store`` is garbage; call
    it to release them now. Not at interpreter exit: in-flight transfers are not waited for there,
    and the exit hook of :mod:`~zeroshard.core.offload.swap_files` removes the directories."""
    fin = weakref.finalize(store, release, io, files, directory, os.getpid())
    fin.atexit = False
    return fin


def _size_of(file: SwapFile) -> str:
    try:
        return f"{os.fstat(file.fileno()).st_size} bytes"
    except OSError as e:
        return f"of unknown size: {e}"


def _move(op: str, fd: int, view: memoryview, pos: int, need: int) -> None:
    """Transfer until ``need`` bytes of ``view`` are done; a transfer that moves nothing is a short one."""
    done = 0
    while done < need:
        if op == "read":
            k = os.preadv(fd, [view[done:]], pos + done)
        else:
            k = os.pwrite(fd, view[done:], pos + done)
        if k <= 0:
            raise _ShortTransfer(f"{done} of {need} bytes moved at file offset {pos}, then the {op} returned {k}")
        done += k
