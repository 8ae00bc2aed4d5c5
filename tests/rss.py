"""A process's real resident memory, for the memory tests: current and peak RSS from /proc."""

from __future__ import annotations

import gc


def status() -> dict[str, int]:
    """``{"VmRSS": bytes, "VmHWM": bytes}``: current and peak resident memory of this process."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> dict[str, int]:
    """Collect garbage, make the peak the current RSS (``clear_refs``), and return :func:`status`."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return status()
