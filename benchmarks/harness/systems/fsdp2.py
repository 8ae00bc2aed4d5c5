"""torch FSDP2: ``fully_shard`` on every transformer block and on the root (ZeRO stage 3)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from benchmarks.harness.spec import Job
from benchmarks.harness.systems.base import TorchLoop, adamw
from benchmarks.harness.workload import blocks_of


def import_library() -> None:
    """Import FSDP2 and the device mesh."""
    import torch.distributed.device_mesh  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401


def build(model: torch.nn.Module, job: Job, device: torch.device) -> TorchLoop:
    """Shard each block then the root; bf16 compute with fp32 reduction on GPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model.to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if job.dtype == "bf16" else MixedPrecisionPolicy()
    for block in blocks_of(model):
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return TorchLoop(model, adamw(model.parameters(), job), job, device)
