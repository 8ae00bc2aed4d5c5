"""torch DDP with ``ZeroRedundancyOptimizer`` (optimizer state sharded: ZeRO stage 1)."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from benchmarks.harness.spec import Job
from benchmarks.harness.systems.base import TorchLoop


def import_library() -> None:
    """Import ``torch.distributed.optim`` (where ``ZeroRedundancyOptimizer`` lives)."""
    import torch.distributed.optim  # noqa: F401


def build(model: torch.nn.Module, job: Job, device: torch.device) -> TorchLoop:
    """DDP as in the DDP baseline, with AdamW's state partitioned across ranks."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model.to(device)
    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
    wl = job.workload
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=wl.lr, betas=wl.betas,
                                  eps=wl.eps, weight_decay=wl.weight_decay, fused=True)
    return TorchLoop(ddp, opt, job, device, ddp=True)
