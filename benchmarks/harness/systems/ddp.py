"""torch DistributedDataParallel with fused AdamW: the unsharded baseline (ZeRO stage 0)."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from benchmarks.harness.spec import Job
from benchmarks.harness.systems.base import TorchLoop, adamw


def import_library() -> None:
    """DDP ships with torch: nothing more to import."""
    import torch.nn.parallel  # noqa: F401


def build(model: torch.nn.Module, job: Job, device: torch.device) -> TorchLoop:
    """DDP (default 25 MiB buckets, gradients as bucket views) and AdamW over all parameters."""
    model.to(device)
    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
    return TorchLoop(ddp, adamw(ddp.parameters(), job), job, device, ddp=True)
