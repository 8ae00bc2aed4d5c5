"""zeroshard's stage 3 at the setting that matches FSDP2's ``reshard_after_forward=True``.

FSDP2 (``fully_shard`` per block) gathers one block ahead and frees each block after its forward
and again after its backward. ``stage3_max_live_parameters`` = ``stage3_prefetch_bucket_size`` = the
parameters of one block does the same in zeroshard (README, "Memory"): the equal-memory
comparison, beside the default, whose live budget keeps a small model gathered for the whole step.
"""

from __future__ import annotations

import torch

from benchmarks.harness.spec import Job
from benchmarks.harness.systems.engine_loop import EngineLoop
from benchmarks.harness.systems.zeroshard_system import build as build_zeroshard
from benchmarks.harness.systems.zeroshard_system import import_library as import_library


def build(model: torch.nn.Module, job: Job, device: torch.device) -> EngineLoop:
    """``zeroshard.initialize`` at stage 3 with one block's parameters as the live and prefetch budget."""
    block = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)  # type: ignore[union-attr]
    return build_zeroshard(model, job, device, {"stage3_max_live_parameters": block,
                                                "stage3_prefetch_bucket_size": block})
