"""The zeroshard checkpoint format: file names and the JSON metadata rank 0 writes.

A tag directory holds::

    rank-00000-of-00002.safetensors   one per rank, written in parallel: this rank's pieces of
    rank-00001-of-00002.safetensors   every trained parameter (``master/<name>``, fp32) and of its
                                      optimizer state (``optim/<key>/<name>``), of every frozen
                                      (not trained) parameter (``frozen/<name>``, in the compute
                                      dtype), and its RNG state
    extra.safetensors                 rank 0: buffers, tensors found in client_state / scheduler
                                      state / param-group options
    zeroshard.json                    rank 0: this metadata
    COMPLETE                          rank 0, written last: the metadata's digest

A *piece* is a contiguous run ``[start, end)`` of a parameter's flattened elements stored in one
rank file. Pieces are exactly the stages' per-parameter chunks (every stage, 3 included, splits a
flattened parameter into ``ceil(numel / world)`` chunks; stage 0, whose ranks all hold everything,
writes the same split so its saves are parallel too). Loading at another world size or stage
reads, for each parameter, the intersection of the range it needs with the stored pieces: no
conversion step. Optimizer state keys are ``sharded`` (same shape as the parameter, stored in
pieces like the master) or ``scalar`` (a 0-d tensor such as Adam's ``step``, stored with every
piece) or ``number`` (a Python number, stored like a scalar). Frozen parameters are stored in
pieces too (``frozen_params``), so that ZeRO-3, which partitions them, saves and loads 1/N of a
frozen base model per rank.

Version 1 (before frozen parameters were partitioned) kept them whole in ``extra.safetensors``
(``frozen``); it is still read.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from zeroshard.checkpoint.collect import NUMBER, SCALAR, SHARDED
from zeroshard.checkpoint.paths import plain_name
from zeroshard.errors import CheckpointError

FORMAT = "zeroshard"
VERSION = 2
#: versions this code reads
READABLE = (1, 2)
EXTRA_FILE = "extra.safetensors"


def rank_file(rank: int, world: int) -> str:
    """Name of rank ``rank``'s shard file in a checkpoint saved by ``world`` ranks."""
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def master_key(name: str) -> str:
    """Tensor name of a parameter's fp32 master piece."""
    return f"master/{name}"


def frozen_key(name: str) -> str:
    """Tensor name of a frozen parameter's piece."""
    return f"frozen/{name}"


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
    """One stored parameter: global shape, param group, stored pieces, optimizer-state keys (a
    frozen parameter: none, group 0)."""

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
    #: version 1: frozen parameters stored whole in ``extra.safetensors`` (none since version 2)
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
    #: frozen parameters, stored in pieces (``frozen/<name>``)
    frozen_params: list[ParamMeta] = field(default_factory=list)
    #: the job's ``gradient_clipping`` (0: none); absent from files saved before it was recorded
    gradient_clipping: float | None = None

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
        if raw.get("version") not in READABLE:
            raise CheckpointError(f"{path} has format version {raw.get('version')}; this zeroshard reads "
                                  f"versions {', '.join(map(str, READABLE))}")
        _validate(raw, path)
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in raw if k not in known)
        if unknown:  # optional fields of a newer zeroshard (formats change by version, not by key)
            warnings.warn(f"{path}: ignoring keys this zeroshard does not know: {', '.join(unknown)} (written by "
                          "a newer version?)", stacklevel=2)
            raw = {k: v for k, v in raw.items() if k in known}
        try:
            for key in ("params", "frozen_params"):
                raw[key] = [ParamMeta(**{**p, "pieces": [Piece(**x) for x in p["pieces"]]}) for p in raw.get(key, [])]
            return cls(**raw)
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{path} is malformed: {e}") from e


def _count(value: Any, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _list_of(value: Any, ok: Callable[[Any], bool]) -> bool:
    return isinstance(value, list) and all(ok(v) for v in value)


def _dict_of(value: Any, ok: Callable[[Any], bool]) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and ok(v) for k, v in value.items())


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _validate(raw: dict[str, Any], path: Path) -> None:
    """Check the types and ranges of every field that loading uses; errors name the file and the key."""

    def expect(ok: bool, key: str, what: str) -> None:
        if not ok:
            raise CheckpointError(f"{path} is malformed: {key} must be {what}")

    expect(_is_str(raw.get("tag")), "tag", "a string")
    expect(_count(raw.get("world_size"), 1), "world_size", "a positive integer")
    expect(raw.get("zero_stage") in (0, 1, 2, 3) and _count(raw.get("zero_stage")), "zero_stage", "0, 1, 2 or 3")
    for key in ("compute_dtype", "optimizer_type"):
        expect(_is_str(raw.get(key)), key, "a string")
    files: Any = raw.get("files")
    expect(_dict_of(files, _count) and all(plain_name(f) for f in files), "files",
           "a map from file names in the checkpoint directory to sizes")
    for key in ("module_keys", "buffers", "frozen"):
        expect(_list_of(raw.get(key), _is_str), key, "a list of names")
    expect(_dict_of(raw.get("aliases"), _is_str), "aliases", "a map from names to names")
    expect(_dict_of(raw.get("counters"), _count), "counters", "a map from names to non-negative integers")
    expect(_dict_of(raw.get("versions", {}), _is_str), "versions", "a map from names to strings")
    for key, kind in (("param_groups", list), ("lr_scheduler", dict), ("loss_scaler", dict), ("dataloader", dict)):
        expect(raw.get(key) is None or isinstance(raw[key], kind), key, f"null or a JSON {kind.__name__}")
    expect(isinstance(raw.get("client_state"), dict), "client_state", "a JSON object")
    clip = raw.get("gradient_clipping")
    expect(clip is None or (isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip >= 0),
           "gradient_clipping", "null or a non-negative number")
    if isinstance(raw.get("param_groups"), list):
        expect(_list_of(raw["param_groups"], lambda g: isinstance(g, dict)), "param_groups", "a list of objects")
    _validate_params(raw.get("params"), "params", files, expect)
    _validate_params(raw.get("frozen_params", []), "frozen_params", files, expect)
    trained = {p["name"] for p in raw["params"]}
    expect(not any(p["name"] in trained for p in raw.get("frozen_params", [])), "frozen_params",
           "names that are not in 'params'")


def _validate_params(params: Any, list_key: str, files: dict[str, int],
                     expect: Callable[[bool, str, str], None]) -> None:
    expect(isinstance(params, list), list_key, "a list")
    for i, p in enumerate(params):
        key = f"{list_key}[{i}]"
        expect(isinstance(p, dict) and _is_str(p.get("name")), key, "an object with a name")
        expect(_list_of(p.get("shape"), _count), f"{key}.shape", "a list of non-negative integers")
        expect(_count(p.get("group")), f"{key}.group", "a non-negative integer")
        expect(_dict_of(p.get("state", {}), lambda k: k in (SHARDED, SCALAR, NUMBER)), f"{key}.state",
               f"a map from names to {SHARDED!r}, {SCALAR!r} or {NUMBER!r}")
        numel = math.prod(p["shape"])
        pieces = p.get("pieces")

        def piece(x: Any, numel: int = numel) -> bool:
            return isinstance(x, dict) and plain_name(x.get("file")) and x["file"] in files \
                and _count(x.get("start")) and _count(x.get("end"), x["start"]) and x["end"] <= numel

        expect(_list_of(pieces, piece), f"{key}.pieces",
               f"a list of element ranges within [0, {numel}] of files listed in 'files'")
        bounds = [0] + [b for x in pieces for b in (x["start"], x["end"])] + [numel]
        expect(bounds[::2] == bounds[1::2] and len({x["file"] for x in pieces}) == len(pieces), f"{key}.pieces",
               f"consecutive ranges covering [0, {numel}), one per file")
