"""This process's real resident memory on Linux, from ``/proc/self``: what the memory benchmarks
report, and the memory tests through ``tests/rss.py`` (``checkpoint_bench.py`` keeps its own,
because its conversion subprocesses import it as a top-level module). Nothing here imports torch."""

from __future__ import annotations


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
