"""Whole-model output in 16 bits: ``engine.save_16bit_model``.

Every rank walks the parameters in the same order; under ZeRO-3 each unit is gathered once (a
collective, so on every rank) and released before the next, and rank 0 streams each parameter to
one safetensors file as it comes, so it holds about one unit at a time plus the write buffer, never
the whole model; persistent buffers follow the parameters. Rank 0's writing holds no collective: a
failure there (a full disk) is kept until the walk is over, then raised on every rank. Tied
parameters are written once, under their first name (as Hugging Face does).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.checkpoint.agree import together
from zeroshard.checkpoint.collect import module_layout
from zeroshard.checkpoint.safetensors_io import SafetensorsWriter, TensorSpec
from zeroshard.core.comm import collectives as C
from zeroshard.core.partition import full_shape
from zeroshard.core.seam import unit_of

logger = logging.getLogger("zeroshard")


def save_16bit_model(engine: Any, save_dir: str | os.PathLike[str], save_filename: str = "model.safetensors",
                     exclude_frozen_parameters: bool = False) -> Path:
    """Write the module's weights in the compute dtype (fp32 when training in fp32), and its persistent
    buffers as they are, from rank 0.

    Collective: call on every rank. Returns the path written (on every rank). A ``.bin`` file name
    is changed to ``.safetensors``: zeroshard never writes pickles.
    """
    name = Path(save_filename)
    if name.suffix == ".bin":
        logger.warning("save_16bit_model: writing safetensors, so %s becomes %s", name,
                       name.with_suffix(".safetensors"))
        name = name.with_suffix(".safetensors")
    path = Path(save_dir) / name
    params = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad or not exclude_frozen_parameters]
    # persistent buffers too (BatchNorm's running statistics), as DeepSpeed writes them: a model
    # loaded from the file without them would be re-initialised there
    tensors = [*params, *module_layout(engine)["buffers"].items()]
    specs = [TensorSpec(n, t.dtype, tuple(full_shape(t))) for n, t in tensors]
    owner = getattr(engine.optimizer, "gather_context", None)
    current: list[Any] = [None, None]  # (unit, exit callable) gathered now

    def produce(p: torch.Tensor) -> torch.Tensor:  # every rank, in the same order
        unit = unit_of(p)
        if unit is not None and unit is not current[0]:
            if current[1] is not None:
                current[1]()
            enter, exit_ = owner([p])  # type: ignore[misc]
            enter()
            current[:] = [unit, exit_]
        return p.detach()

    rank = dist.get_rank() if dist.is_initialized() else 0
    error: Exception | None = None

    def on_rank_0(fn: Callable[..., Any], *args: Any) -> Any:
        """Run rank 0's part of the write; keep its failure for after the walk."""
        nonlocal error
        if rank != 0 or error is not None:
            return None
        try:
            with C.on_ranks([0], "writing the 16-bit model, which runs on rank 0 only"):
                return fn(*args)
        except Exception as e:  # raised once every rank has finished the walk
            error = e
            return None

    def open_file() -> SafetensorsWriter:
        path.parent.mkdir(parents=True, exist_ok=True)
        return SafetensorsWriter(path, specs, metadata={"format": "pt", "written_by": "zeroshard"})

    def walk() -> int:
        writer: SafetensorsWriter | None = None
        try:
            writer = on_rank_0(open_file)
            for _, p in tensors:
                t = produce(p)
                if writer is not None:
                    on_rank_0(writer.write, t)
            size: int = on_rank_0(writer.finish) if writer is not None else 0
        finally:
            if current[1] is not None:
                current[1]()
            if writer is not None:
                writer.close()
        if error is not None:
            raise error
        return size

    # Raised on every rank if rank 0 failed; also: nobody returns before the file is written.
    size = together(walk, None, f"save_16bit_model: writing {path}")
    if rank == 0:
        logger.info("saved %d tensors (%.1f MB) to %s", len(specs), size / 2**20, path)
    return path
