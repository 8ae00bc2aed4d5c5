"""Memory figures for the progress report: this process's host RSS and the accelerator's allocator.

Host: the resident set from ``/proc/self/statm`` (Linux, no dependency: psutil is not a core
requirement), and the peak from ``resource.getrusage`` (``ru_maxrss``, KiB on Linux, bytes on
macOS); either is ``None`` where the platform has no such source. Device: the caching allocator's
allocated and peak-allocated bytes (CUDA, or any ``torch.accelerator`` backend that reports them);
``None`` on the CPU.
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

import torch


class MemorySample(NamedTuple):
    """Bytes at one moment; ``None`` where not measurable here."""

    host_rss: int | None
    host_peak: int | None
    device_allocated: int | None
    device_peak: int | None


def host_rss_bytes() -> int | None:
    """Resident set size of this process now (Linux ``/proc``), else ``None``."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            resident_pages = int(f.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def host_peak_bytes() -> int | None:
    """Peak resident set size of this process (``getrusage``), else ``None``."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def device_bytes(device: torch.device) -> tuple[int | None, int | None]:
    """``(allocated, peak allocated)`` on ``device``'s allocator, ``(None, None)`` on the CPU."""
    if device.type == "cpu":
        return None, None
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device)), int(torch.cuda.max_memory_allocated(device))
    acc = getattr(torch, "accelerator", None)  # torch >= 2.8 reports other backends' allocators here
    try:
        return int(acc.memory_allocated(device.index)), int(acc.max_memory_allocated(device.index))  # type: ignore[union-attr]
    except (AttributeError, RuntimeError, TypeError):
        return None, None


def sample(device: torch.device) -> MemorySample:
    """Host and device memory now."""
    allocated, peak = device_bytes(device)
    return MemorySample(host_rss_bytes(), host_peak_bytes(), allocated, peak)


def gib(n: int | None) -> str:
    """``1.23GiB`` or ``n/a``."""
    return "n/a" if n is None else f"{n / 2**30:.2f}GiB"


def describe(m: MemorySample) -> str:
    """``host=1.21GiB (peak 1.30GiB) device=n/a``."""
    host = gib(m.host_rss) + (f" (peak {gib(m.host_peak)})" if m.host_peak is not None else "")
    device = gib(m.device_allocated) + (f" (peak {gib(m.device_peak)})" if m.device_peak is not None else "")
    return f"host={host} device={device}"
