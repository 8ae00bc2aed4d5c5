"""A process's real resident memory, for the memory tests: current and peak RSS from /proc.

:func:`status` and :func:`resident` are the benchmarks' readers (``benchmarks/harness/proc_memory.py``);
the tests' peak reset is stricter than theirs (it fails where the kernel refuses, and collects
garbage first).
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for benchmarks/
from benchmarks.harness.proc_memory import resident, status  # noqa: E402

__all__ = ["reset_peak", "resident", "status"]


def reset_peak() -> dict[str, int]:
    """Collect garbage, make the peak the current RSS (``clear_refs``), and return :func:`status`."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return status()
