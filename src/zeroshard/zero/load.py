"""Load pretrained weights into a partitioned model, tensor by tensor.

``load_weights(model, source)`` fills each parameter from a state dict or from safetensors files
(one file, a directory, or a Hugging Face ``*.safetensors.index.json``). Where a parameter is
partitioned (built under ``zero.Init``, or owned by a ZeRO-3 engine) each rank reads only its own
element range of the tensor straight from the file, so no rank ever holds the whole model, nor
even a whole tensor when reading from safetensors.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.checkpoint.safetensors_io import SafetensorsReader
from zeroshard.core.partition import INIT_CHUNK_ATTR, ShardLayout, full_numel
from zeroshard.core.seam import owner_of
from zeroshard.errors import CheckpointError

Reader = Callable[[str, int, int], torch.Tensor]


def _open_source(source: Mapping[str, torch.Tensor] | str | Path) -> tuple[set[str], Reader, Callable[[], None]]:
    """Names available and a ``read(name, lo, hi)`` of flattened elements."""
    if isinstance(source, Mapping):
        return set(source), lambda n, lo, hi: source[n].detach().reshape(-1)[lo:hi], lambda: None
    path = Path(source)
    if path.is_dir():
        index = next(iter(sorted(path.glob("*.safetensors.index.json"))), None)
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()}) if index \
            else sorted(path.glob("*.safetensors"))
    elif path.is_file():
        files = [path]
    else:
        raise CheckpointError(f"no weights at {path}: expected a .safetensors file, a directory of them, or a "
                              "state dict")
    if not files:
        raise CheckpointError(f"{path} holds no .safetensors file")
    readers = [SafetensorsReader(f) for f in files]
    where = {name: r for r in readers for name in r.tensors}

    def close() -> None:
        for r in readers:
            r.close()

    return set(where), lambda n, lo, hi: where[n].read(n, lo, hi), close


def load_weights(model: torch.nn.Module, source: Mapping[str, torch.Tensor] | str | Path, strict: bool = True) -> None:
    """Copy weights by parameter name into ``model``, partitioned or not.

    Args:
        model: a module built under ``zero.Init``, a ZeRO engine's ``engine.module``, or a plain one.
        source: a state dict, a ``.safetensors`` file, or a directory of them (with or without an index).
        strict: raise if a parameter has no tensor in ``source`` or ``source`` has names the model lacks.
    """
    names, read, close = _open_source(source)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    params = dict(model.named_parameters())
    missing = [n for n in params if n not in names]
    unexpected = sorted(names - set(params) - {n for n, _ in model.named_parameters(remove_duplicate=False)})
    if strict and (missing or unexpected):
        close()
        raise CheckpointError(f"load_weights: missing {missing[:10]}{'...' if len(missing) > 10 else ''}, "
                              f"unexpected {unexpected[:10]}{'...' if len(unexpected) > 10 else ''}")
    owners: dict[int, Any] = {}
    try:
        with torch.no_grad():
            for name, p in params.items():
                if name in names:
                    _load_one(p, name, read, rank, world, owners)
        for owner in owners.values():
            owner.publish()  # masters changed: refresh the 16-bit shards / module parameters
    finally:
        close()


def _load_one(p: torch.nn.Parameter, name: str, read: Reader, rank: int, world: int, owners: dict[int, Any]) -> None:
    numel = full_numel(p)
    chunk = getattr(p, INIT_CHUNK_ATTR, None)
    owner = owner_of(p)
    if chunk is not None:  # built under zero.Init, not yet adopted by an engine
        s, e = ShardLayout(numel, world).local_range(rank)
        chunk.copy_(read(name, s, e))
    elif owner is not None and owner.frozen is not None and p in owner.frozen.ranges:
        s, e = owner.frozen.ranges[p]  # a frozen parameter partitioned by ZeRO-3: its chunk is the truth
        owner.frozen.write(p, read(name, s, e))
        owners[id(owner)] = owner
    elif owner is not None:  # owned by an engine: its master chunk is the truth
        s, e = owner.master.ranges[p]
        owner.store.write_master(owner.master.views[p], read(name, s, e))
        owners[id(owner)] = owner
    else:
        p.data.copy_(read(name, 0, numel).view_as(p))
