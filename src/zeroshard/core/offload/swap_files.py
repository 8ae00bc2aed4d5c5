"""Swap files and swap directories for NVMe offload, and aligned host buffers to fill them from.

The I/O engine (:mod:`zeroshard.core.offload.aio`) reads and writes the files made here. A run puts its
files in a fresh directory per process and rank, ``<nvme_path>/zeroshard-swap-<host>-<pid>-<random>/rank<r>``
(:func:`swap_dir`): two runs, or two ranks, never share a file, and a directory left by a crashed
run is never reused. :func:`remove_swap_dir` deletes it; an ``atexit`` hook deletes what is left on
a clean interpreter exit (and a ``multiprocessing`` finalizer at the end of a child process). A
process killed (SIGKILL, the OOM killer; SIGTERM from torchrun when another rank fails) leaves its
directory; the next run on the same host removes those of processes that no longer exist
(:func:`remove_stale_swap_dirs`), so they neither pile up nor fill the disk.

A :class:`SwapFile` is preallocated at creation (``posix_fallocate``), so a disk too small fails
then and not in the middle of training, and is opened once, with ``O_DIRECT`` where the filesystem
takes it (bypassing the page cache, which would otherwise grow by every byte swapped). ``O_DIRECT``
needs the memory address, the file offset and the length of each transfer to be multiples of
:data:`ALIGNMENT`; :func:`aligned_empty` makes buffers whose address is.
"""

from __future__ import annotations

import atexit
import errno
import logging
import multiprocessing.util
import os
import re
import secrets
import shutil
import socket
import threading
from pathlib import Path
from types import TracebackType
from typing import Any, cast

import torch

from zeroshard.errors import ConfigError, OffloadIOError

__all__ = [
    "ALIGNMENT",
    "SwapFile",
    "aligned_empty",
    "byte_view",
    "check_free_space",
    "remove_stale_swap_dirs",
    "remove_swap_dir",
    "round_up",
    "swap_dir",
]

logger = logging.getLogger("zeroshard")

ALIGNMENT = 4096
"""Bytes: the logical block size assumed for ``O_DIRECT`` (that of every NVMe drive and most disks)."""

_GIB = float(1 << 30)
_RUN_PREFIX = "zeroshard-swap-"


def round_up(n: int, multiple: int = ALIGNMENT) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def aligned_empty(numel: int, dtype: torch.dtype, alignment: int = ALIGNMENT, pin: bool = False) -> torch.Tensor:
    """A 1-D host tensor whose data pointer is a multiple of ``alignment`` bytes (for ``O_DIRECT``).

    Args:
        numel: number of elements.
        dtype: element type.
        alignment: byte alignment of the first element (a multiple of the element size).
        pin: allocate page-locked memory, when CUDA is available (ignored otherwise).

    Returns:
        An uninitialised tensor; its storage is up to ``alignment`` bytes larger than it.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    if numel < 0 or alignment <= 0 or alignment % itemsize:
        raise ValueError(f"aligned_empty: numel {numel} must be >= 0 and alignment {alignment} a positive "
                         f"multiple of the element size {itemsize}")
    nbytes = numel * itemsize
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())
    skip = -raw.data_ptr() % alignment
    return raw[skip : skip + nbytes].view(dtype)


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable, zero-copy memoryview of the bytes of a contiguous 1-D ``uint8`` CPU tensor."""
    # numpy arrays have the buffer protocol; the cast is for numpy's stubs, which do not declare it.
    return memoryview(cast(Any, t.numpy()))


def _human(nbytes: int) -> str:
    return f"{nbytes} bytes ({nbytes / _GIB:.2f} GiB)"


def check_free_space(directory: Path, nbytes: int, what: str) -> None:
    """Check that ``directory`` is a writable directory (created, with its parents, when it does not
    exist, as DeepSpeed does) with ``nbytes`` bytes free (after removing the swap directories of dead
    processes of this host: :func:`remove_stale_swap_dirs`).

    Args:
        directory: where swap files will go (the config's ``nvme_path``).
        nbytes: bytes the swap files will take.
        what: the config key that named the directory (``"zero_optimization.offload_optimizer.nvme_path"``);
            it becomes the error's ``key``.

    Raises:
        ConfigError: naming the path, and for too little space the bytes needed and available.
    """
    directory = Path(directory)
    if not directory.exists():
        # DeepSpeed creates it (os.makedirs): a config naming a fresh path works unchanged
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"{directory} does not exist and cannot be created ({e.strerror}); create it or point "
                              "the key at another directory", key=what) from e
        logger.info("zeroshard: created %s (%s) for the swap files", directory, what)
    if not directory.is_dir():
        raise ConfigError(f"{directory} is not a directory; swap files need a directory to go in", key=what)
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"{directory} is not writable by this process (uid {os.getuid()})", key=what)
    remove_stale_swap_dirs(directory)
    free = shutil.disk_usage(directory).free
    if free < nbytes:
        raise ConfigError(
            f"swap files under {directory} need {_human(nbytes)} but its filesystem has {_human(free)} free",
            key=what,
        )


class _SwapDirs:
    """The swap directories this process created, removed on a clean interpreter exit, or at the
    end of a ``multiprocessing`` child (``torch.multiprocessing.spawn``, a notebook's ``Process``),
    which leaves through ``os._exit`` after its finalizers and never runs ``atexit`` hooks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dirs: set[Path] = set()
        self._hooked_pid = 0

    def add(self, rank_dir: Path) -> None:
        with self._lock:
            self._dirs.add(rank_dir)
            if self._hooked_pid != os.getpid():  # not yet in this process (a forked child inherits the flag)
                self._hooked_pid = os.getpid()
                atexit.register(self.remove_all, os.getpid())
                multiprocessing.util.Finalize(None, self.remove_all, args=(os.getpid(),), exitpriority=0)

    def discard(self, rank_dir: Path) -> None:
        with self._lock:
            self._dirs.discard(rank_dir)

    def remove_all(self, owner_pid: int) -> None:
        # A forked child inherits the hook; only the process that made the directories removes them.
        if os.getpid() != owner_pid:
            return
        with self._lock:
            dirs = list(self._dirs)
        for d in dirs:
            remove_swap_dir(d)


_SWAP_DIRS = _SwapDirs()


def swap_dir(nvme_path: Path, rank: int) -> Path:
    """Create a fresh directory for this process's swap files:
    ``nvme_path/zeroshard-swap-<host>-<pid>-<hex>/rank<r>``.

    The directory is removed with everything in it by :func:`remove_swap_dir`, and by an ``atexit``
    hook on a clean interpreter exit; a crash leaves it (the name says which process made it).
    """
    nvme_path = Path(nvme_path)
    nvme_path.mkdir(parents=True, exist_ok=True)
    run_dir = nvme_path / f"{_RUN_PREFIX}{_host()}-{os.getpid()}-{secrets.token_hex(4)}"
    run_dir.mkdir(exist_ok=False)  # never reuse a directory, even one with the same pid from a past run
    rank_dir = run_dir / f"rank{rank}"
    rank_dir.mkdir()
    _SWAP_DIRS.add(rank_dir)
    return rank_dir


def _host() -> str:
    """This host's name as it goes in a swap directory's name (no ``-``, which separates the fields)."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_swap_dirs(nvme_path: Path) -> int:
    """Remove the swap directories under ``nvme_path`` that processes of this host made and that no
    longer exist (killed before they could clean up); returns the bytes freed.

    Directories of other hosts (a shared filesystem) and of live processes are never touched, nor
    anything else under ``nvme_path``: swap files hold nothing a later run can use (checkpoints are
    written elsewhere).
    """
    freed, host = 0, _host()
    for entry in Path(nvme_path).glob(f"{_RUN_PREFIX}*"):
        fields = entry.name[len(_RUN_PREFIX):].rsplit("-", 2)
        if len(fields) != 3 or fields[0] != host or not fields[1].isdigit() or _alive(int(fields[1])):
            continue
        size = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
        shutil.rmtree(entry, ignore_errors=True)
        if not entry.exists():
            freed += size
            logger.warning("removed %s (%s) left by process %s of this host, which no longer runs",
                           entry, _human(size), fields[1])
    return freed


def remove_swap_dir(directory: Path) -> None:
    """Remove a directory made by :func:`swap_dir`, its files, and its per-run parent once empty."""
    directory = Path(directory)
    _SWAP_DIRS.discard(directory)
    shutil.rmtree(directory, ignore_errors=True)
    parent = directory.parent
    if parent.name.startswith(_RUN_PREFIX):
        try:
            parent.rmdir()
        except OSError:
            pass  # another rank directory of the same run is still there


class SwapFile:
    """One preallocated scratch file of ``nbytes`` bytes, opened once for the engine's reads and writes.

    Attributes:
        path: the file.
        nbytes: its usable size (the file on disk is rounded up to :data:`ALIGNMENT`, so a transfer
            whose length is not a multiple of it can still be done in whole blocks).
        direct: whether the file is open with ``O_DIRECT``. When not, the engine drops the pages it
            touched from the page cache after each transfer (``posix_fadvise(DONTNEED)``).

    Args:
        path: a file that does not exist yet (it is created; an existing file is an error).
        nbytes: the bytes to preallocate.
        direct: ``None`` to use ``O_DIRECT`` when the filesystem supports it (probed with one
            block), ``False`` for buffered I/O, ``True`` to require ``O_DIRECT``.

    Raises:
        OffloadIOError: the file exists, the filesystem has no room for it, or ``direct=True`` and
            the filesystem does not support ``O_DIRECT``.
    """

    def __init__(self, path: Path, nbytes: int, *, direct: bool | None = None) -> None:
        if nbytes < 0:
            raise ValueError(f"SwapFile {path}: nbytes must be >= 0, got {nbytes}")
        self.path = Path(path)
        self.nbytes = nbytes
        self.direct = False
        self._fd: int | None = None
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise OffloadIOError(f"cannot create swap file {self.path}: {e}", str(self.path), e.errno) from e
        self._fd = fd
        try:
            self._preallocate(round_up(max(nbytes, 1)))
            if direct is not False:
                self._try_direct(required=direct is True)
        except BaseException:
            self.close(remove=True)
            raise

    def _preallocate(self, size: int) -> None:
        assert self._fd is not None
        try:
            os.posix_fallocate(self._fd, 0, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise OffloadIOError(
                    f"cannot preallocate {_human(size)} for swap file {self.path}: {e}", str(self.path), e.errno
                ) from e
            os.ftruncate(self._fd, size)  # a filesystem without fallocate: a sparse file of the right size

    def _try_direct(self, required: bool) -> None:
        # Some filesystems refuse O_DIRECT at open, others only at the first transfer: probe both.
        flag = getattr(os, "O_DIRECT", 0)
        reason = "this platform has no O_DIRECT"
        if flag:
            try:
                fd = os.open(self.path, os.O_RDWR | flag)
            except OSError as e:
                reason = f"open with O_DIRECT failed: {e}"
            else:
                probe = byte_view(aligned_empty(ALIGNMENT, torch.uint8).zero_())
                try:
                    os.pwrite(fd, probe, 0)
                    os.preadv(fd, [probe], 0)
                except OSError as e:
                    os.close(fd)
                    reason = f"a transfer with O_DIRECT failed: {e}"
                else:
                    assert self._fd is not None
                    os.close(self._fd)
                    self._fd, self.direct = fd, True
                    return
        if required:
            raise OffloadIOError(f"swap file {self.path}: direct=True but {reason}", str(self.path))

    def fileno(self) -> int:
        """The open file descriptor (``O_DIRECT`` when :attr:`direct`)."""
        if self._fd is None:
            raise OffloadIOError(f"swap file {self.path} is closed", str(self.path))
        return self._fd

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._fd is None

    def close(self, remove: bool = True) -> None:
        """Close the file (idempotent), and delete it when ``remove``. Wait for its transfers first."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if remove:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> SwapFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SwapFile({str(self.path)!r}, nbytes={self.nbytes}, direct={self.direct})"
