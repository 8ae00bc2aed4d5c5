"""Where the numbers come from: machine, library versions, date (parent side, no torch import)."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as md
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        pass
    if dist == "zeroshard":  # run from a checkout that is not pip-installed (gpu.sh sets PYTHONPATH)
        init = Path(__file__).resolve().parents[2] / "src" / "zeroshard" / "__init__.py"
        found = re.search(r'^__version__ = "([^"]+)"', init.read_text(), re.M) if init.exists() else None
        if found:
            return f"{found.group(1)} (from src/)"
    return "not installed"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def _gpus() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def _git() -> str:
    """HEAD of the zeroshard checkout, and whether ``src/`` has uncommitted changes."""
    repo = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=repo, capture_output=True,
                               text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head} + uncommitted changes in src/" if dirty else head


def allocator_settings() -> dict[str, str]:
    """The C allocator's settings from the environment, which every benchmark process inherits
    (glibc reads them at start-up: ``MALLOC_*_`` variables and ``GLIBC_TUNABLES``)."""
    return {k: v for k, v in sorted(os.environ.items()) if k == "GLIBC_TUNABLES" or
            (k.startswith("MALLOC_") and k.endswith("_"))}


def allocator_text(settings: dict[str, str]) -> str:
    """:func:`allocator_settings` as the reports write it."""
    return "; ".join(f"`{k}={v}`" for k, v in settings.items()) or "glibc's defaults"


def describe() -> dict[str, Any]:
    """Machine and software facts recorded with every result file."""
    mem = _memory_gib()
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "memory_gib": round(mem, 1) if mem else None,
        "gpus": _gpus(),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "torch": _version("torch"),
        "deepspeed": _version("deepspeed"),
        "zeroshard": _version("zeroshard"),
        "zeroshard_git": _git(),
        "allocator": allocator_settings(),
    }
