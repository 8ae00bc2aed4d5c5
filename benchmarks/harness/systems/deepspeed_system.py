"""DeepSpeed 0.19.x with the same config (torch's fused AdamW via ``torch_adam``)."""

from __future__ import annotations

import torch

from benchmarks.harness.spec import Job
from benchmarks.harness.systems.base import deepspeed_config
from benchmarks.harness.systems.engine_loop import EngineLoop


def import_library() -> None:
    """``import deepspeed`` (it detects the accelerator and loads its op builders)."""
    import deepspeed  # noqa: F401


def build(model: torch.nn.Module, job: Job, device: torch.device) -> EngineLoop:
    """``deepspeed.initialize`` with the shared config."""
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=deepspeed_config(job))
    return EngineLoop(engine)
