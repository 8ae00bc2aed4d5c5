"""Host memory the process gives back: freed heap pages (glibc's ``malloc_trim``), and buffers
of zeroshard's own that live outside the heap.

glibc keeps freed heap memory for reuse, and after the first large free it raises its mmap
threshold (up to 32 MiB), so later tensors of that size come from the heap too. A training step
frees and reallocates activations, gathered ZeRO-3 units and reduce buckets in a different
order every micro-step; the heap fragments and the process's resident memory grows step after
step, far above what is live (measured in ``docs/performance.md``: 300-400 MiB on a 25M-parameter
GPT). ``malloc_trim(0)`` returns every free page of every arena (``madvise``), without changing
any allocator setting: the user's process keeps glibc's defaults.

``zero.Init`` calls :func:`trim` after each few MiB of parameters it frees (it would otherwise
grow a rank by more than the whole model; the cost is paid once), and so does the first step with
NVMe optimizer offload after each sub-group's new optimizer state has gone to its swap files.
ZeRO-3 training on the CPU trims every 32 MiB of units released in backward, which returns the
activations and autograd's buffers freed so far before the gradient shard and the master rows
fault in their pages: the 120M benchmark GPT
peaks at 1,500 MiB per rank instead of 1,675 at the defaults, 1,342 instead of 1,687 with one block
live, for 3-8% of step time (``docs/performance.md``). ``ZEROSHARD_MALLOC_TRIM=1`` also trims at
the end of each backward and optimizer step (little more memory, more time);
``ZEROSHARD_MALLOC_TRIM=0`` turns every trim off. No allocator setting is ever changed, and it
is a no-op where the C library has no ``malloc_trim`` (musl, macOS, Windows) and for device
memory (CUDA's caching allocator is separate).

Independently of trimming, zeroshard keeps its own large, short-lived host buffers out of the heap
altogether (:func:`empty`, :class:`MappedBuffer`): each gets an anonymous mapping of its own, which
goes back to the system when the buffer is freed or dropped, so these buffers neither fragment
the heap between the model's activations nor push glibc's mmap threshold up. Mappings of 2 MiB or
more ask for transparent huge pages (``MADV_HUGEPAGE``), so refilling a dropped buffer costs a
few page faults instead of one per 4 KiB. This is the default on CPU; it is what brings ZeRO-3's
training peak down by 100-150 MiB on the 25M-parameter benchmark GPT at no measurable step time
(``docs/performance.md``). Device memory is never touched: on an accelerator both fall back to
``torch.empty``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import tempfile
import weakref
from collections.abc import Callable
from typing import Any, Literal

import torch


def _load() -> Any:
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_MALLOC_TRIM = _load()


def _mode() -> str:
    return os.environ.get("ZEROSHARD_MALLOC_TRIM", "")


#: where a trim is asked for: ``"setup"`` (``zero.Init``, the first NVMe offload step) and
#: ``"release"`` (ZeRO-3 units released in training) unless ``ZEROSHARD_MALLOC_TRIM=0``; ``"step"``
#: (the end of each backward and optimizer step) only with ``ZEROSHARD_MALLOC_TRIM=1``
TrimSite = Literal["setup", "release", "step"]


def enabled(site: TrimSite = "setup") -> bool:
    """Whether zeroshard returns freed host memory at ``site`` (see :data:`TrimSite`)."""
    if _MALLOC_TRIM is None or _mode() == "0":
        return False
    return _mode() == "1" if site == "step" else True


def trim(device: torch.device | None = None, site: TrimSite = "setup") -> None:
    """Return free heap pages to the system; nothing for a non-CPU ``device``."""
    if (device is None or device.type == "cpu") and enabled(site):
        _MALLOC_TRIM(0)


class TrimEvery:
    """Calls :func:`trim` once at least ``bytes_between`` bytes were freed since the last call
    (each call walks the heap: once per freed tensor would cost more than it returns)."""

    def __init__(self, bytes_between: int, site: TrimSite = "setup") -> None:
        self.bytes_between = bytes_between
        self.site: TrimSite = site
        self._freed = 0

    def freed(self, nbytes: int) -> None:
        """Note ``nbytes`` freed; trim when enough have been."""
        self._freed += nbytes
        if self._freed >= self.bytes_between:
            self._freed = 0
            trim(site=self.site)


#: CPU buffers below this size stay with the C allocator: a mapping per small buffer would cost a
#: system call for little gain.
MAPPED_MIN_BYTES = 1 << 20
_HUGE_PAGE = 2 << 20


def _mapped_bytes(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= _HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    # The tensor holds the mapping through the buffer protocol: it is unmapped when the last tensor
    # viewing it is freed.
    return mapping, torch.frombuffer(mapping, dtype=torch.uint8, count=max(nbytes, 1))[:nbytes]


def _mapped() -> bool:
    return hasattr(mmap, "MAP_ANONYMOUS") and os.environ.get("ZEROSHARD_HOST_MAPPED", "1") != "0"


def mappable(device: torch.device, nbytes: int, min_bytes: int = MAPPED_MIN_BYTES) -> bool:
    """Whether a buffer of ``nbytes`` on ``device`` gets a mapping of its own (:func:`empty`).
    ``min_bytes`` lowers the size limit for a buffer made once (one system call is nothing then)."""
    return device.type == "cpu" and nbytes >= min_bytes and _mapped()


def empty(numel: int, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
    """``torch.empty(numel, dtype=dtype, device=device)``; a large CPU buffer gets an anonymous
    mapping of its own, returned to the system as soon as the tensor (and every view) is freed.

    For zeroshard's transient buffers (gradient shards, collective scratch): freed through malloc
    they would leave holes in the heap between activations that the process keeps.
    ``ZEROSHARD_HOST_MAPPED=0`` turns mapping off.
    """
    device = torch.device(device if device is not None else "cpu")
    if not mappable(device, numel * dtype.itemsize):
        return torch.empty(numel, dtype=dtype, device=device)
    return _mapped_bytes(numel * dtype.itemsize)[1].view(dtype)


class MappedBuffer:
    """A reusable CPU buffer whose pages are handed back to the system by :meth:`drop` while the
    tensors viewing it stay valid (a dropped page reads as zero until written again).

    ZeRO-3 gathers each large unit into one, so that the views autograd saved of its weights read
    the next gather's values, as ``untyped_storage().resize_(0)`` allows through the allocator, but
    without the heap. Use it where :func:`mappable` holds.
    """

    def __init__(self, nbytes: int) -> None:
        self._map, self._bytes = _mapped_bytes(nbytes)

    def tensor(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole buffer as a 1-D tensor of ``dtype`` (its size a multiple of the item size)."""
        return self._bytes.view(dtype)

    def drop(self, start: int = 0, length: int | None = None) -> int:
        """Return the pages to the system (``MADV_DONTNEED``); the buffer stays usable. With a byte
        range, only the pages wholly inside it (a page it shares with bytes outside keeps them).
        Returns the bytes dropped."""
        end = len(self._map) if length is None else min(start + length, len(self._map))
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        last = end if end == len(self._map) else end // mmap.PAGESIZE * mmap.PAGESIZE
        if last <= first:
            return 0
        self._map.madvise(mmap.MADV_DONTNEED, first, last - first)
        return last - first


class FileMappedBuffer:
    """A CPU buffer backed by a file of its own (a shared mapping of an unlinked file under
    ``directory``), whose pages :meth:`drop` takes out of the process while their values stay:
    in the page cache, written to the file when the system needs the memory. The process then
    holds only the pages in use, whatever the buffer's size.

    For state that outgrows host memory (the fp32 gradient shard of a ZeRO-Infinity run, next to
    the swap files of its optimizer state). The file is removed from the directory at once: it
    disappears with the last tensor viewing the buffer, also when the process dies.
    """

    def __init__(self, directory: os.PathLike[str] | str, nbytes: int) -> None:
        fd, path = tempfile.mkstemp(prefix="spill-", suffix=".buf", dir=directory)
        try:
            os.unlink(path)
            os.ftruncate(fd, max(nbytes, 1))  # sparse: the disk holds only what is written back
            self._map = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.nbytes = nbytes
        #: bytes removed from the file by :meth:`discard` so far
        self.discarded = 0
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8, count=max(nbytes, 1))[:nbytes]
        # Registered by its mapping, which lives as long as any tensor viewing it (not this object)
        key = id(self._map)
        _FILE_BACKED[key] = (self._bytes.data_ptr(), self.nbytes, weakref.ref(self._map, _unregister(key)))

    def tensor(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole buffer as a 1-D tensor of ``dtype``."""
        return self._bytes.view(dtype)

    def drop(self, start: int = 0, length: int | None = None) -> int:
        """Take the pages of a byte range out of the process (``MADV_DONTNEED`` on a shared file
        mapping keeps their values); pages it shares with bytes outside the range too (they read
        back their values from the page cache). Returns the bytes dropped."""
        return _drop_shared(self._map, self.nbytes, start, self.nbytes if length is None else length)

    def discard(self, start: int, length: int) -> int:
        """Throw a byte range's values away: its whole pages are removed from the file
        (``MADV_REMOVE``: they read as zeros after, and are never written back, where dropped dirty
        pages would be), the partial pages at its ends only dropped (:meth:`drop`: they hold bytes
        outside the range). Returns the bytes removed from the file."""
        removed = _discard_shared(self._map, self.nbytes, start, length)
        self.discarded += removed
        return removed


def _unregister(key: int) -> Callable[[object], None]:
    def forget(_ref: object) -> None:
        _FILE_BACKED.pop(key, None)

    return forget


def _drop_shared(mapping: mmap.mmap, nbytes: int, start: int, length: int) -> int:
    end = min(start + length, nbytes)
    first = start // mmap.PAGESIZE * mmap.PAGESIZE
    last = min(-(-end // mmap.PAGESIZE) * mmap.PAGESIZE, len(mapping))
    if last <= first:
        return 0
    mapping.madvise(mmap.MADV_DONTNEED, first, last - first)
    return last - first


def _discard_shared(mapping: mmap.mmap, nbytes: int, start: int, length: int) -> int:
    end = min(start + length, nbytes)
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = end // mmap.PAGESIZE * mmap.PAGESIZE
    if last <= first or not hasattr(mmap, "MADV_REMOVE"):
        _drop_shared(mapping, nbytes, start, length)
        return 0
    try:  # Linux's hole punching through a mapping: tmpfs, ext4, xfs and btrfs support it
        mapping.madvise(mmap.MADV_REMOVE, first, last - first)
    except OSError:  # a filesystem without it: the values stay, in the page cache
        _drop_shared(mapping, nbytes, start, length)
        return 0
    if first > start:
        _drop_shared(mapping, nbytes, start, first - start)
    if end > last:
        _drop_shared(mapping, nbytes, last, end - last)
    return last - first


#: live file-backed mappings: id -> (address, bytes, the mapping), for :func:`drop_file_pages`
_FILE_BACKED: dict[int, tuple[int, int, weakref.ReferenceType[mmap.mmap]]] = {}


def discard_file_pages(t: torch.Tensor) -> int:
    """Throw ``t``'s values away when ``t`` lies in a :class:`FileMappedBuffer` (see
    :meth:`FileMappedBuffer.discard`), also after the buffer object is gone while ``t`` keeps its
    mapping alive; anything else is left alone. Returns the bytes removed from the file."""
    found = _file_backed(t)
    return 0 if found is None else _discard_shared(found[0], found[1], t.data_ptr() - found[2],
                                                   t.numel() * t.element_size())


def _file_backed(t: torch.Tensor) -> tuple[mmap.mmap, int, int] | None:
    """``(mapping, bytes, address)`` of the file-backed buffer ``t`` starts in, if any."""
    if t.device.type != "cpu" or not t.numel() or not _FILE_BACKED:
        return None
    start = t.data_ptr()
    for base, nbytes, ref in list(_FILE_BACKED.values()):
        mapping = ref()
        if mapping is not None and base <= start < base + nbytes:
            return mapping, nbytes, base
    return None


def drop_file_pages(t: torch.Tensor) -> int:
    """Take ``t``'s pages out of the process when ``t`` lies in a :class:`FileMappedBuffer` (its
    values stay, in the page cache); anything else is left alone. Returns the bytes dropped."""
    found = _file_backed(t)
    return 0 if found is None else _drop_shared(found[0], found[1], t.data_ptr() - found[2],
                                                t.numel() * t.element_size())
