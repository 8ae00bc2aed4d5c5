"""This process's real resident memory on Linux, from ``/proc/self`` and ``mincore(2)``: what the
memory benchmarks report, and the memory tests through ``tests/rss.py`` (``studies/checkpoint_cost.py``
keeps its own, because its conversion subprocesses import it as a top-level module). Nothing here
imports torch."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap


def status() -> dict[str, int]:
    """``{"VmRSS": bytes, "VmHWM": bytes}``: current and peak resident memory of this process.

    ``VmHWM``, unlike ``ru_maxrss``, is not inherited across ``exec`` and can be reset.
    """
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> None:
    """Make the peak the current RSS (``clear_refs``); a no-op where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
    except OSError:
        pass


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def resident(ptr: int, nbytes: int) -> int:
    """Bytes of ``[ptr, ptr + nbytes)`` that are in memory, as the kernel says (``mincore(2)``).

    A buffer whose pages were handed back (``MADV_DONTNEED``: a released ZeRO-3 unit's mapping, a
    master row lent to a gathered unit) keeps its size but holds no memory.
    """
    page = mmap.PAGESIZE
    lo = ptr // page * page
    pages = -(-(ptr + nbytes - lo) // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = _libc()
    if libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(pages * page), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    in_memory = pages - bytes(vec).count(0)  # the low bit marks a resident page; the rest are 0
    return min(nbytes, in_memory * page)
