"""Give freed host memory back to the operating system (glibc's ``malloc_trim``).

glibc keeps freed heap memory for reuse, and after the first large free it raises its mmap
threshold (up to 32 MiB), so later tensors of that size come from the heap too. A training step
frees and reallocates activations, gathered ZeRO-3 units and reduce buckets in a different
order every micro-step; the heap fragments and the process's resident memory grows step after
step, far above what is live (measured in ``benchmarks/PROFILE.md``: 300-400 MiB on a 25M-parameter
GPT). ``malloc_trim(0)`` returns every free page of every arena (``madvise``), without changing
any allocator setting: the user's process keeps glibc's defaults.

``zero.Init`` calls :func:`trim` after each few MiB of parameters it frees (it would otherwise
grow a rank by more than the whole model; the cost is paid once). In training it is an opt-in,
because it costs step time (10-20% on the CPU benchmark, ``benchmarks/PROFILE.md``):
``ZEROSHARD_MALLOC_TRIM=1`` also trims at the end of each backward and optimizer step and every
32 MiB of ZeRO-3 units released (CPU only), which lowers the training peak by 150-300 MiB there.
``ZEROSHARD_MALLOC_TRIM=0`` turns every trim off. No allocator setting is ever changed, and it
is a no-op where the C library has no ``malloc_trim`` (musl, macOS, Windows) and for device
memory (CUDA's caching allocator is separate).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

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


def enabled(training: bool = False) -> bool:
    """Whether zeroshard returns freed host memory: in ``zero.Init`` unless turned off, in
    training only when asked for (``ZEROSHARD_MALLOC_TRIM=1``)."""
    if _MALLOC_TRIM is None or _mode() == "0":
        return False
    return _mode() == "1" if training else True


def trim(device: torch.device | None = None, training: bool = False) -> None:
    """Return free heap pages to the system; nothing for a non-CPU ``device``."""
    if (device is None or device.type == "cpu") and enabled(training):
        _MALLOC_TRIM(0)


class TrimEvery:
    """Calls :func:`trim` once at least ``bytes_between`` bytes were freed since the last call
    (each call walks the heap: once per freed tensor would cost more than it returns)."""

    def __init__(self, bytes_between: int, training: bool = False) -> None:
        self.bytes_between = bytes_between
        self.training = training
        self._freed = 0

    def freed(self, nbytes: int) -> None:
        """Note ``nbytes`` freed; trim when enough have been."""
        self._freed += nbytes
        if self._freed >= self.bytes_between:
            self._freed = 0
            trim(training=self.training)
