"""zeroshard, driven exactly like DeepSpeed (``import zeroshard as deepspeed``)."""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.harness.spec import Job
from benchmarks.harness.systems.base import NotAvailable, deepspeed_config
from benchmarks.harness.systems.engine_loop import EngineLoop

PERSISTENT = ("parameters", "gradients", "master_weights", "optimizer_states")
"""``memory_usage()`` entries that persist between steps (model state). Others, such as stage 3's
``gathered_peak`` (parameters gathered transiently for compute), are kept in the JSON only."""


def import_library() -> None:
    """``import zeroshard`` (what a user's script pays before ``initialize``)."""
    import zeroshard  # noqa: F401


def build(model: torch.nn.Module, job: Job, device: torch.device,
          zero: dict[str, Any] | None = None) -> EngineLoop:
    """``zeroshard.initialize`` with the shared config (``zero`` merged into its
    ``zero_optimization``); a not-yet-supported feature is reported."""
    import zeroshard

    config = deepspeed_config(job)
    config["zero_optimization"].update(zero or {})
    try:
        engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    except zeroshard.NotYetSupportedError as exc:
        raise NotAvailable(f"not yet available: {exc}") from exc

    def breakdown() -> dict[str, int]:
        mb = engine.memory_usage()
        persistent = sum(v for k, v in mb.items() if k in PERSISTENT)
        return {"total": persistent, **{f"zeroshard_{k}": v for k, v in mb.items()}}

    return EngineLoop(engine, breakdown)
