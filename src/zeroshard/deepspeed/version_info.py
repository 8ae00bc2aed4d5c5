"""``deepspeed.git_version_info``: what DeepSpeed's installer records, answered by zeroshard.

DeepSpeed's ``setup.py`` writes the release, the git commit and branch it was built from, the ops it
compiled (``installed_ops``), the accelerator it was built for and the torch it was built against
(``torch_info``). Scripts and DeepSpeed's own tests read them to decide what to run
(``torch_info["cuda_version"]``, bf16 checks). Here:

* ``version``: ``deepspeed.__version__`` under the layer (DeepSpeed's release plus zeroshard's label);
* ``git_hash``, ``git_branch``: ``"unknown"``, as a DeepSpeed installed from a wheel says;
* ``installed_ops``: every op ``False`` (zeroshard compiles none, :mod:`zeroshard.deepspeed.op_builder`);
* ``accelerator_name``: ``"cuda"`` or ``"cpu"``, the accelerator of this process;
* ``torch_info``: the installed torch: ``version`` (major.minor), ``bf16_support`` (CUDA bf16),
  ``cuda_version``, ``nccl_version`` and ``hip_version`` (major.minor, ``"0.0"`` when torch has none,
  the value DeepSpeed's readers treat as absent).
"""

from __future__ import annotations

import torch

from zeroshard.deepspeed.accelerator import get_accelerator
from zeroshard.deepspeed.imports import DISTRIBUTION_VERSION
from zeroshard.deepspeed.op_builder import INSTALLED_OPS

__all__ = ["accelerator_name", "git_branch", "git_hash", "installed_ops", "torch_info", "version"]

_ABSENT = "0.0"


def _major_minor(version: str | None) -> str:
    """``"12.4"`` from ``"12.4.1"`` (or ``"2.13"`` from ``"2.13.0+cpu"``); ``"0.0"`` for none."""
    if not version:
        return _ABSENT
    parts = version.split("+", 1)[0].split(".")
    return ".".join((parts + ["0"])[:2])


def _nccl_version() -> str:
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "nccl"):
        return _ABSENT
    try:
        nccl = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return _ABSENT
    return ".".join(str(v) for v in nccl[:2]) if isinstance(nccl, tuple) else _major_minor(str(nccl))


def _torch_info() -> dict[str, object]:
    cuda = torch.cuda.is_available()
    return {
        "version": _major_minor(torch.__version__),
        "bf16_support": bool(cuda and torch.cuda.is_bf16_supported()),
        "cuda_version": _major_minor(torch.version.cuda),
        "nccl_version": _nccl_version(),
        "hip_version": _major_minor(getattr(torch.version, "hip", None)),
    }


version = DISTRIBUTION_VERSION
git_hash = "unknown"
git_branch = "unknown"
installed_ops = INSTALLED_OPS
accelerator_name = get_accelerator().device_name()
torch_info = _torch_info()
