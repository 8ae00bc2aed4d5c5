"""A checkpoint opened for reading, whatever wrote it: the interface load and convert use.

:class:`CheckpointSource` presents a checkpoint as named parameters with global shapes whose
fp32 masters and elementwise optimizer state can be read by *element range* (``read``), plus
scalar state, buffers, counters and the rest. Loading at any world size asks each parameter for
exactly the range the rank owns; consolidation asks for whole parameters one at a time. Two
implementations: :class:`ZeroshardSource` here and
:class:`~zeroshard.checkpoint.deepspeed.DeepSpeedSource`; :func:`open_source` picks by format.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zeroshard.checkpoint.collect import NUMBER
from zeroshard.checkpoint.jsonable import decode
from zeroshard.checkpoint.metadata import EXTRA_FILE, CheckpointMeta, frozen_key, master_key, optim_key, rank_file
from zeroshard.checkpoint.paths import META_FILE
from zeroshard.checkpoint.safetensors_io import SafetensorsReader
from zeroshard.errors import CheckpointError

MASTER = "master"


@dataclass
class SourceParam:
    """A trained parameter as stored: global shape, param group and optimizer-state kinds."""

    name: str
    shape: tuple[int, ...]
    group: int
    state: dict[str, str] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        """Elements of the full parameter."""
        return math.prod(self.shape)


def fill_range(pieces: Sequence[tuple[int, int, Any]], lo: int, hi: int, dtype: torch.dtype,
               out: torch.Tensor | None, copy: Callable[[Any, int, int, torch.Tensor], None],
               what: str) -> torch.Tensor:
    """Assemble elements ``[lo, hi)``, stored as ``dtype``, from ``(start, end, handle)`` pieces.

    ``copy(handle, a, b, dst)`` writes the elements ``[a, b)`` (parameter coordinates) into the
    ``dtype`` tensor ``dst``. The result goes into ``out`` when given (directly if it is a
    contiguous ``dtype`` tensor), else into a new tensor. Raises :class:`CheckpointError` if some
    element is in no piece.
    """
    direct = out is not None and out.dtype == dtype and out.is_contiguous()
    buf = out.view(-1) if direct and out is not None else torch.empty(hi - lo, dtype=dtype)
    if buf.numel() != hi - lo:
        raise ValueError(f"{what}: output has {buf.numel()} elements, the range {hi - lo}")
    covered = 0
    for start, end, handle in pieces:
        a, b = max(start, lo), min(end, hi)
        if a < b:
            copy(handle, a, b, buf[a - lo : b - lo])
            covered += b - a
    if covered != hi - lo:
        raise CheckpointError(f"{what}: the checkpoint holds {covered} of the elements [{lo}, {hi}) (missing shard?)")
    if out is None:
        return buf
    if not direct:
        out.copy_(buf.view_as(out))
    return out


class CheckpointSource:
    """Base class; attributes are filled by the implementations."""

    path: Path
    format: str
    world_size: int
    zero_stage: int
    params: dict[str, SourceParam]
    module_keys: list[str]
    aliases: dict[str, str]
    buffers: list[str]
    frozen: list[str]
    param_groups: list[dict[str, Any]] | None
    lr_scheduler: Any
    loss_scaler: dict[str, Any] | None
    counters: dict[str, int]
    dataloader: Any
    client_state: dict[str, Any]
    #: the saving job's gradient clipping (0: none), where the checkpoint records it
    gradient_clipping: float | None = None

    def read(self, key: str, name: str, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattened master (``key="master"``) or sharded state ``key``.

        With ``out`` (``hi - lo`` elements, any dtype) the values are written into it, straight
        from the file when it is contiguous and of the stored dtype; returns ``out`` then.
        """
        raise NotImplementedError

    def read_scalar(self, key: str, name: str) -> Any:
        """A scalar or number optimizer-state entry of parameter ``name``."""
        raise NotImplementedError

    def read_extra(self, name: str) -> torch.Tensor:
        """A buffer or frozen parameter, whole, in its saved dtype."""
        raise NotImplementedError

    def frozen_shape(self, name: str) -> tuple[int, ...]:
        """The shape of frozen parameter ``name``."""
        return tuple(self.read_extra(name).shape)

    def read_frozen(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of frozen parameter ``name``'s flattened value, in its saved dtype."""
        return self.read_extra(name).reshape(-1)[lo:hi]

    def rng(self, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """Rank ``rank``'s saved RNG state, if the checkpoint has one."""
        return None

    def read_full(self, name: str) -> torch.Tensor:
        """A trained parameter's whole fp32 value in its shape, or a frozen one's as saved."""
        if name in self.params:
            p = self.params[name]
            return self.read(MASTER, name, 0, p.numel).view(p.shape)
        return self.read_extra(name)

    def close(self) -> None:
        """Release open files."""

    def __enter__(self) -> CheckpointSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ZeroshardSource(CheckpointSource):
    """A checkpoint in zeroshard's own format (see :mod:`zeroshard.checkpoint.metadata`)."""

    format = "zeroshard"

    def __init__(self, path: Path) -> None:
        self.path = path
        meta = CheckpointMeta.from_file(path / META_FILE)
        for fname, size in meta.files.items():
            f = path / fname
            actual = f.stat().st_size if f.is_file() else -1
            if actual != size:
                state = "missing" if actual < 0 else f"{actual} bytes instead of {size}"
                raise CheckpointError(f"checkpoint file {f} is {state}: the checkpoint is damaged")
        self.meta = meta
        self._readers: dict[str, SafetensorsReader] = {}
        self.world_size, self.zero_stage = meta.world_size, meta.zero_stage
        self._pieces = {p.name: [(x.start, x.end, x.file) for x in p.pieces] for p in meta.params}
        self.params = {p.name: SourceParam(p.name, tuple(p.shape), p.group, dict(p.state)) for p in meta.params}
        self.module_keys, self.aliases = meta.module_keys, meta.aliases
        self.buffers = meta.buffers
        # version 2 stores frozen parameters in pieces; version 1 whole, in the extra file
        self._frozen = {p.name: (tuple(p.shape), [(x.start, x.end, x.file) for x in p.pieces])
                        for p in meta.frozen_params}
        self.frozen = [*meta.frozen, *self._frozen]
        extra = self._reader(EXTRA_FILE)
        tables = {k: extra.read(k).view(extra.info(k).shape) for k in extra.tensors if k.startswith("meta/")}
        try:
            self.param_groups = decode(meta.param_groups, tables)
            self.lr_scheduler = decode(meta.lr_scheduler, tables)
            self.client_state = decode(meta.client_state, tables)
        except CheckpointError as e:
            raise CheckpointError(f"{path / META_FILE}: {e}") from None
        self.loss_scaler, self.counters, self.dataloader = meta.loss_scaler, meta.counters, meta.dataloader
        self.gradient_clipping = meta.gradient_clipping

    def _reader(self, fname: str) -> SafetensorsReader:
        if fname not in self._readers:
            self._readers[fname] = SafetensorsReader(self.path / fname)
        return self._readers[fname]

    def _tensor_key(self, key: str, name: str) -> str:
        return master_key(name) if key == MASTER else optim_key(key, name)

    def read(self, key: str, name: str, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the master or a sharded state, from the pieces that hold them."""
        return self._read_pieces(self._tensor_key(key, name), self._pieces[name], lo, hi, out)

    def _read_pieces(self, tkey: str, pieces: list[tuple[int, int, str]], lo: int, hi: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        for s, e, f in pieces:  # before allocating anything by the metadata's word
            if s < hi and lo < e and self._reader(f).info(tkey).numel != e - s:
                raise CheckpointError(f"{self.path / f}: {tkey} has {self._reader(f).info(tkey).numel} elements, "
                                      f"the metadata says {e - s}: the checkpoint is corrupt")
        dtype = self._reader(pieces[0][2]).info(tkey).dtype if pieces else torch.float32

        def copy(fname: str, a: int, b: int, dst: torch.Tensor) -> None:
            start = next(s for s, _e, f in pieces if f == fname)  # a file holds one piece per parameter
            self._reader(fname).read(tkey, a - start, b - start, out=dst)

        return fill_range(pieces, lo, hi, dtype, out, copy, f"{self.path}: {tkey}")

    def read_scalar(self, key: str, name: str) -> Any:
        """From the first piece (every piece stores the same value)."""
        fname = self._pieces[name][0][2]
        reader = self._reader(fname)
        value = reader.read(optim_key(key, name))
        if value.numel() != 1:
            raise CheckpointError(f"{self.path / fname}: {optim_key(key, name)} has {value.numel()} elements, "
                                  "expected a scalar: the checkpoint is corrupt")
        value = value.reshape(())
        if self.params[name].state.get(key) == NUMBER:
            return value.item()
        return value

    def frozen_shape(self, name: str) -> tuple[int, ...]:
        """From the metadata (version 2), or the extra file's header (version 1)."""
        if name in self._frozen:
            return self._frozen[name][0]
        return tuple(self._reader(EXTRA_FILE).info(frozen_key(name)).shape)

    def read_frozen(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """From the pieces that hold the range (version 2)."""
        if name in self._frozen:
            return self._read_pieces(frozen_key(name), self._frozen[name][1], lo, hi)
        return super().read_frozen(name, lo, hi)

    def read_extra(self, name: str) -> torch.Tensor:
        """A buffer or frozen parameter, whole: assembled from its pieces, or from ``extra.safetensors``."""
        if name in self._frozen:
            shape = self._frozen[name][0]
            return self.read_frozen(name, 0, math.prod(shape)).view(shape)
        reader = self._reader(EXTRA_FILE)
        for prefix in ("buffer/", "frozen/"):
            if prefix + name in reader:
                info = reader.info(prefix + name)
                return reader.read(prefix + name).view(info.shape)
        raise CheckpointError(f"{self.path / EXTRA_FILE} has no buffer or frozen parameter {name!r}")

    def rng(self, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """The RNG tensors and record of rank ``rank`` (``None`` beyond the saved world size)."""
        if rank >= self.world_size:
            return None
        reader = self._reader(rank_file(rank, self.world_size))
        tensors = {k: reader.read(k).view(reader.info(k).shape) for k in reader.tensors if k.startswith("rng/")}
        try:
            record = json.loads(reader.metadata.get("rng", "{}"))
        except ValueError as e:
            raise CheckpointError(f"{reader.path}: malformed RNG record: {e}") from e
        if not isinstance(record, dict):
            raise CheckpointError(f"{reader.path}: malformed RNG record: not a JSON object")
        return tensors, record

    def close(self) -> None:
        """Close every open shard file."""
        for r in self._readers.values():
            r.close()
        self._readers.clear()
