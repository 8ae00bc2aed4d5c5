"""Whole-model output in 16 bits: ``engine.save_16bit_model``.

Rank 0 writes one safetensors file while every rank walks the parameters in the same order; under
ZeRO-3 each unit is gathered once, streamed to disk parameter by parameter, and released before
the next, so rank 0 holds about one unit at a time plus the write buffer, never the whole model.
Tied parameters are written once, under their first name (as Hugging Face does).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.checkpoint.safetensors_io import TensorSpec, write_safetensors
from zeroshard.partition import full_shape

logger = logging.getLogger("zeroshard")


def save_16bit_model(engine: Any, save_dir: str | os.PathLike[str], save_filename: str = "model.safetensors",
                     exclude_frozen_parameters: bool = False) -> Path:
    """Write the module's weights in the compute dtype (fp32 when training in fp32) from rank 0.

    Returns the path written (on every rank). A ``.bin`` file name is changed to ``.safetensors``:
    zeroshard never writes pickles.
    """
    name = Path(save_filename)
    if name.suffix == ".bin":
        logger.warning("save_16bit_model: writing safetensors, so %s becomes %s", name,
                       name.with_suffix(".safetensors"))
        name = name.with_suffix(".safetensors")
    path = Path(save_dir) / name
    params = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad or not exclude_frozen_parameters]
    specs = [TensorSpec(n, p.dtype, tuple(full_shape(p))) for n, p in params]
    by_name = dict(params)
    owner = getattr(engine.optimizer, "gather_context", None)
    current: list[Any] = [None, None]  # (unit, exit callable) gathered now

    def produce(spec: TensorSpec) -> torch.Tensor:
        p = by_name[spec.name]
        unit = getattr(p, "_zeroshard_unit", None)
        if unit is not None and unit is not current[0]:
            if current[1] is not None:
                current[1]()
            enter, exit_ = owner([p])  # type: ignore[misc]
            enter()
            current[:] = [unit, exit_]
        return p.detach().cpu()

    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        if rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            size = write_safetensors(path, specs, produce, metadata={"format": "pt", "written_by": "zeroshard"})
            logger.info("saved %d tensors (%.1f MB) to %s", len(specs), size / 2**20, path)
        else:
            for spec in specs:
                produce(spec)
    finally:
        if current[1] is not None:
            current[1]()
    if dist.is_initialized():
        dist.barrier()
    return path
