"""The zeroshard checkpoint format: file names and the JSON metadata rank 0 writes.

A tag directory holds::

    rank-00000-of-00002.safetensors   one per rank, written in parallel: this rank's pieces of
    rank-00001-of-00002.safetensors   every trained parameter (``master/<name>``, fp32) and of its
                                      optimizer state (``optim/<key>/<name>``), and its RNG state
    extra.safetensors                 rank 0: buffers, frozen parameters, tensors found in
                                      client_state / scheduler state / param-group options
    zeroshard.json                    rank 0: this metadata
    COMPLETE                          rank 0, written last: the metadata's digest

A *piece* is a contiguous run ``[start, end)`` of a parameter's flattened elements stored in one
rank file. Pieces are exactly the stages' per-parameter chunks (every stage, 3 included, splits a
flattened parameter into ``ceil(numel / world)`` chunks; stage 0, whose ranks all hold everything,
writes the same split so its saves are parallel too). Loading at another world size or stage
reads, for each parameter, the intersection of the range it needs with the stored pieces: no
conversion step. Optimizer state keys are ``sharded`` (same shape as the parameter, stored in
pieces like the master) or ``scalar`` (a 0-d tensor such as Adam's ``step``, stored with every
piece) or ``number`` (a Python number, stored like a scalar).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zeroshard.errors import CheckpointError

FORMAT = "zeroshard"
VERSION = 1
EXTRA_FILE = "extra.safetensors"


def rank_file(rank: int, world: int) -> str:
    """Name of rank ``rank``'s shard file in a checkpoint saved by ``world`` ranks."""
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def master_key(name: str) -> str:
    """Tensor name of a parameter's fp32 master piece."""
    return f"master/{name}"


def optim_key(key: str, name: str) -> str:
    """Tensor name of a parameter's optimizer-state piece."""
    return f"optim/{key}/{name}"


@dataclass
class Piece:
    """Elements ``[start, end)`` of a flattened parameter, stored in ``file``."""

    file: str
    start: int
    end: int


@dataclass
class ParamMeta:
    """One trained parameter: global shape, param group, stored pieces, optimizer-state keys."""

    name: str
    shape: list[int]
    group: int
    pieces: list[Piece]
    state: dict[str, str] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        """Elements of the full parameter."""
        return math.prod(self.shape)


@dataclass
class CheckpointMeta:
    """Everything rank 0 records about a checkpoint (``zeroshard.json``)."""

    tag: str
    world_size: int
    zero_stage: int
    compute_dtype: str
    params: list[ParamMeta]
    files: dict[str, int]
    module_keys: list[str]
    aliases: dict[str, str]
    buffers: list[str]
    frozen: list[str]
    optimizer_type: str
    param_groups: Any
    lr_scheduler: Any
    loss_scaler: dict[str, Any] | None
    counters: dict[str, int]
    dataloader: Any
    client_state: Any
    format: str = FORMAT
    version: int = VERSION
    versions: dict[str, str] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        """The JSON document."""
        return json.dumps(asdict(self), indent=1).encode()

    @classmethod
    def from_file(cls, path: Path) -> CheckpointMeta:
        """Parse and validate ``zeroshard.json``; errors name the file."""
        try:
            raw = json.loads(path.read_bytes())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read checkpoint metadata {path}: {e}") from e
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not zeroshard checkpoint metadata")
        if raw.get("version") != VERSION:
            raise CheckpointError(f"{path} has format version {raw.get('version')}; this zeroshard reads "
                                  f"version {VERSION}")
        try:
            raw["params"] = [ParamMeta(**{**p, "pieces": [Piece(**x) for x in p["pieces"]]}) for p in raw["params"]]
            return cls(**raw)
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{path} is malformed: {e}") from e
