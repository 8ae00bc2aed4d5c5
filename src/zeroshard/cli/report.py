"""``zeroshard report``: the environment as zeroshard sees it, like DeepSpeed's ``ds_report``.

Versions (zeroshard, Python, torch, CUDA, cuDNN, NCCL), accelerators and their memory, the CPU,
``torch.distributed`` backends, pinned memory, async I/O for NVMe offload (swap files, O_DIRECT), the fast CPU
optimizer path (torch's fused AdamW on CPU) and optional packages with their versions. Each check
is ``[OKAY]`` (green), ``[NO]`` (red) or ``[WARNING]`` (yellow) with a remark; plain text, and
nothing is compiled or downloaded. Colours follow ``--color`` (``auto``: on a terminal, unless
``NO_COLOR`` is set). Always exits with 0: a missing feature is information, not an error.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

OKAY, NO, WARN, INFO = "OKAY", "NO", "WARNING", ""
_COLORS = {OKAY: "\033[92m", NO: "\033[91m", WARN: "\033[93m"}
_END = "\033[0m"

#: optional packages reported with their versions (never imported)
OPTIONAL_PACKAGES = ("transformers", "accelerate", "tensorboard", "wandb", "deepspeed", "tqdm", "psutil")
REQUIRED_PACKAGES = ("torch", "pydantic", "safetensors")


@dataclass(frozen=True)
class Check:
    """One line of the report: ``label ..... [STATUS] detail`` (``status`` empty: plain information)."""

    label: str
    status: str
    detail: str


Section = tuple[str, list[Check]]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _general() -> Section:
    import torch

    import zeroshard

    checks = [
        Check("zeroshard", INFO, f"{zeroshard.__version__} ({os.path.dirname(zeroshard.__file__ or '')})"),
        Check("python", INFO, f"{platform.python_version()} ({sys.executable})"),
        Check("platform", INFO, platform.platform()),
        Check("torch", INFO, f"{torch.__version__} ({os.path.dirname(torch.__file__ or '')})"),
    ]
    cuda = torch.version.cuda
    hip = getattr(torch.version, "hip", None)
    if cuda:
        checks.append(Check("torch built with CUDA", OKAY, cuda))
    elif hip:
        checks.append(Check("torch built with ROCm", OKAY, hip))
    else:
        checks.append(Check("torch built with CUDA", NO, "CPU-only build"))
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    checks.append(Check("cuDNN", OKAY if cudnn else NO, str(cudnn) if cudnn else "not available"))
    checks.append(_nccl(torch))
    return "general", checks


def _nccl(torch: Any) -> Check:
    if not (torch.version.cuda or getattr(torch.version, "hip", None)):
        return Check("NCCL", NO, "not in a CPU-only torch build")
    try:
        v = torch.cuda.nccl.version()
    except Exception as e:  # torch raises RuntimeError, or AttributeError on builds without it
        return Check("NCCL", NO, f"unavailable ({type(e).__name__}: {e})")
    return Check("NCCL", OKAY, ".".join(map(str, v)) if isinstance(v, tuple) else str(v))


def _cpu_memory() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _accelerators() -> Section:
    import torch

    checks = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            checks.append(Check(f"cuda:{i}", OKAY, f"{props.name}, {props.total_memory / 2**30:.1f} GiB, "
                                                   f"compute capability {props.major}.{props.minor}"))
    else:
        other = getattr(torch, "accelerator", None)
        kind = other.current_accelerator() if other is not None and other.is_available() else None
        if kind is not None:
            checks.append(Check(str(kind), OKAY, f"{other.device_count()} device(s)"))  # type: ignore[union-attr]
        else:
            checks.append(Check("accelerators", WARN, "none found: training runs on the CPU with gloo"))
    mem = _cpu_memory()
    checks.append(Check("cpu", INFO, f"{os.cpu_count()} logical cores"
                                     + (f", {mem / 2**30:.1f} GiB memory" if mem else "")))
    return "accelerators", checks


def _backends() -> Section:
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed backends", [Check("torch.distributed", NO, "not built into this torch")]
    probes: dict[str, Callable[[], bool]] = {
        "gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available,
        "mpi": dist.is_mpi_available, "ucc": getattr(dist, "is_ucc_available", lambda: False),
    }
    checks = [Check(name, OKAY if probe() else NO, "available" if probe() else "not available")
              for name, probe in probes.items()]
    import torch

    default = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    checks.append(Check("zeroshard uses", INFO, default))
    return "torch.distributed backends", checks


def _pinned_memory() -> Check:
    import torch

    if not torch.cuda.is_available():
        return Check("pinned memory", NO, "needs a CUDA accelerator")
    try:
        torch.empty(1024, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as e:
        return Check("pinned memory", NO, f"allocation failed: {e}")
    return Check("pinned memory", OKAY, "page-locked host allocation works")


def _async_io() -> Check:
    """NVMe offload reads and writes swap files from a thread pool (no libaio, nothing compiled);
    O_DIRECT (no page cache) is probed on the temporary directory."""
    import tempfile
    from pathlib import Path

    from zeroshard.core.offload.swap_files import SwapFile

    with tempfile.TemporaryDirectory() as d:
        try:
            f = SwapFile(Path(d) / "probe.swp", 4096)
        except OSError as e:
            return Check("async I/O (NVMe offload)", NO, f"cannot create a swap file in {d}: {e}")
        direct = f.direct
        f.close(remove=True)
    how = "O_DIRECT" if direct else "buffered I/O (no O_DIRECT on this filesystem; pages are dropped after use)"
    return Check("async I/O (NVMe offload)", OKAY, f"thread pool over preadv/pwrite, {how} in {tempfile.gettempdir()}")


def _fast_cpu_optimizer() -> Check:
    import torch

    p = torch.nn.Parameter(torch.zeros(16))
    p.grad = torch.ones(16)
    try:
        torch.optim.AdamW([p], lr=1e-3, fused=True).step()
    except (RuntimeError, TypeError, ValueError) as e:
        return Check("fast CPU optimizer", NO, f"torch's fused AdamW on CPU unavailable ({e})")
    simd = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
        simd = ", ".join(x for x in ("avx512f", "avx2", "fma") if x in flags)
    except OSError:
        pass
    return Check("fast CPU optimizer", OKAY, "torch's fused AdamW on CPU" + (f" ({simd})" if simd else ""))


def _features() -> Section:
    return "features", [_pinned_memory(), _async_io(), _fast_cpu_optimizer()]


def _packages() -> Section:
    checks = []
    for name in REQUIRED_PACKAGES:
        v = _version(name)
        checks.append(Check(name, OKAY if v else NO, v or "missing (required)"))
    for name in OPTIONAL_PACKAGES:
        v = _version(name)
        checks.append(Check(name, OKAY if v else NO, v or "not installed (optional)"))
    return "packages", checks


def collect() -> list[Section]:
    """Every section of the report, in order."""
    return [_general(), _accelerators(), _backends(), _features(), _packages()]


def render(sections: list[Section], color: bool) -> str:
    """The report as text; ``color`` wraps statuses in ANSI green/red/yellow."""
    width = max(len(c.label) for _, checks in sections for c in checks) + 4
    lines = ["zeroshard report", "=" * 60]
    for title, checks in sections:
        lines += ["", title, "-" * len(title)]
        for c in checks:
            status = ""
            if c.status:
                status = f"[{c.status}]"
                if color:
                    status = f"{_COLORS[c.status]}{status}{_END}"
                status += " "
            lines.append(f"{c.label} {'.' * (width - len(c.label))} {status}{c.detail}")
    return "\n".join(lines)


def build_parser(prog: str) -> argparse.ArgumentParser:
    """The command's argument parser."""
    p = argparse.ArgumentParser(prog=prog, description="Report versions, accelerators, backends, optional features "
                                                       "and packages (like DeepSpeed's ds_report).")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="colour the statuses (auto: on a terminal unless NO_COLOR is set)")
    return p


def main(argv: Sequence[str], prog: str = "zeroshard report") -> int:
    """Run the command; returns 0."""
    args = build_parser(prog).parse_args(list(argv))
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty() and "NO_COLOR" not in os.environ)
    print(render(collect(), color))
    return 0
