"""Device shim: the accelerator when there is one, the CPU otherwise.

Everything device-specific (which device a rank uses, synchronisation, peak-memory counters) goes
through here so that the rest of the code runs unchanged on CPU with gloo and on CUDA with NCCL.
"""

from __future__ import annotations

import torch


def default_device(local_rank: int) -> torch.device:
    """``cuda:<local_rank>`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak bytes allocated on an accelerator since start, or ``None`` on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None
