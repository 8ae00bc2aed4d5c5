"""Tensors of a ``torch.save`` archive, read on demand instead of at unpickling time.

:class:`LazyStorage` locates one storage's bytes inside the zip archive (torch stores them
uncompressed, so a positioned read fetches any byte range); :class:`LazyTensor` is a view of a
storage (offset, shape, stride) that reads its elements, whole or by flat range, only when asked.
A DeepSpeed rank's optimizer file can thus be opened for the cost of its pickle alone.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any

import torch

from zeroshard.errors import CheckpointError


class LazyStorage:
    """A storage's bytes inside a zip entry (positioned reads), or in memory if compressed."""

    __slots__ = ("path", "offset", "nbytes", "data")

    def __init__(self, path: Path, offset: int, nbytes: int, data: bytes | None = None) -> None:
        self.path, self.offset, self.nbytes, self.data = path, offset, nbytes, data

    def read(self, start: int, out: torch.Tensor) -> None:
        """Fill ``out`` with the bytes at ``start`` (bytes offset) of this storage."""
        view = out.view(torch.uint8).numpy().data.cast("B")
        if start + view.nbytes > self.nbytes:
            raise CheckpointError(f"{self.path}: tensor data beyond its storage (truncated or corrupt file)")
        if self.data is not None:
            view[:] = self.data[start : start + view.nbytes]
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done = 0
            while done < view.nbytes:
                got = os.preadv(fd, [view[done:]], self.offset + start + done)
                if got <= 0:
                    raise CheckpointError(f"{self.path}: unexpected end of file")
                done += got
        finally:
            os.close(fd)


class LazyTensor:
    """A tensor in a ``.pt`` file, read on demand: whole (:meth:`load`) or by flat range (:meth:`read`)."""

    __slots__ = ("storage", "dtype", "offset", "shape", "stride")

    def __init__(self, storage: LazyStorage, dtype: torch.dtype, offset: int, shape: tuple[int, ...],
                 stride: tuple[int, ...]) -> None:
        self.storage, self.dtype, self.offset, self.shape, self.stride = storage, dtype, offset, shape, stride

    def _span(self) -> int:
        """Elements from the first to one past the last that the view touches."""
        return 1 + sum((d - 1) * s for d, s in zip(self.shape, self.stride)) if self.numel() else 0

    def check(self) -> None:
        """Raise :class:`CheckpointError` unless the view lies inside its storage (before anything is
        allocated by a size that the file merely claims)."""
        esize = torch.empty((), dtype=self.dtype).element_size()
        if (len(self.stride) != len(self.shape) or self.offset < 0 or min(self.shape, default=0) < 0
                or min(self.stride, default=0) < 0 or (self.offset + self._span()) * esize > self.storage.nbytes):
            raise CheckpointError(f"{self.storage.path}: a tensor of shape {self.shape}, stride {self.stride} at "
                                  f"element {self.offset} lies outside its storage of {self.storage.nbytes} bytes "
                                  "(truncated or corrupt file)")

    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    def dim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    def _contiguous(self) -> bool:
        expected, acc = [], 1
        for d in reversed(self.shape):
            expected.append(acc)
            acc *= d
        return all(d == 1 or s == e for d, s, e in zip(self.shape, self.stride, reversed(expected)))

    def read(self, lo: int = 0, hi: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattened tensor, as a new 1-D tensor (or into ``out``)."""
        hi = self.numel() if hi is None else hi
        if not self._contiguous():
            return self.load().reshape(-1)[lo:hi].clone()
        if not 0 <= lo <= hi <= self.numel():
            raise CheckpointError(f"{self.storage.path}: range [{lo}, {hi}) outside a tensor of shape {self.shape}")
        buf = torch.empty(hi - lo, dtype=self.dtype) if out is None else out
        if buf.numel():
            self.storage.read((self.offset + lo) * buf.element_size(), buf)
        return buf

    def load(self) -> torch.Tensor:
        """The whole tensor."""
        if self._contiguous():
            return self.read().view(self.shape)
        esize = torch.empty((), dtype=self.dtype).element_size()
        flat = torch.empty(self.offset + self._span(), dtype=self.dtype)
        self.storage.read(0, flat[: self.storage.nbytes // esize])
        return flat.as_strided(self.shape, self.stride, self.offset).clone()

    def __repr__(self) -> str:
        return f"LazyTensor(shape={self.shape}, dtype={self.dtype})"


def materialize(obj: Any) -> Any:
    """Replace every :class:`LazyTensor` in plain containers by a real tensor (for small values)."""
    if isinstance(obj, LazyTensor):
        return obj.load()
    if isinstance(obj, dict):
        return type(obj)((k, materialize(v)) for k, v in obj.items()) if isinstance(obj, collections.OrderedDict) \
            else {k: materialize(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [materialize(v) for v in obj]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        return tuple(materialize(v) for v in obj)
    return obj
