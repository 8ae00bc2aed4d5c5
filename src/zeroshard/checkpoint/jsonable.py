"""Plain data with tensors, as JSON plus a table of named tensors (no pickle in either direction).

``client_state``, scheduler states and similar user-shaped values are stored as JSON in the
checkpoint metadata; every tensor inside them is replaced by ``{"__tensor__": name}`` and saved
in a safetensors file. Tuples and dicts with non-string keys survive the round trip through
``{"__tuple__": [...]}`` and ``{"__items__": [[key, value], ...]}``. Anything else (arbitrary
objects, which only pickle could store) is refused with the path of the offending value.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import torch

from zeroshard.checkpoint.safetensors_io import dtype_code
from zeroshard.errors import CheckpointError

TENSOR, TUPLE, ITEMS = "__tensor__", "__tuple__", "__items__"
_RESERVED = frozenset({TENSOR, TUPLE, ITEMS})


class TensorTable:
    """Tensors collected while encoding, named ``<prefix><index>``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.tensors: dict[str, torch.Tensor] = {}

    def add(self, t: torch.Tensor) -> str:
        """Store ``t`` (detached, on CPU) and return its name."""
        name = f"{self.prefix}{len(self.tensors)}"
        self.tensors[name] = t.detach().cpu()
        return name


def encode(obj: Any, table: TensorTable, where: str) -> Any:
    """JSON-serializable form of ``obj``; tensors go to ``table``.

    Raises:
        CheckpointError: naming the path (``where`` plus keys/indices) of a value that is neither
            plain data nor a tensor.
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if _is_numpy_bool(obj):  # `loss < best` on numpy values: stored as the bool it is, as numpy's ints are ints
        return bool(obj)
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)  # NaN and infinities are written as Python's json writes them
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided:  # refused here, before anything is written, naming where it is
            raise CheckpointError(f"{where} is a {obj.layout} tensor, which a checkpoint cannot store; "
                                  "store it dense (.to_dense())")
        try:
            dtype_code(obj.dtype)
        except CheckpointError as e:
            raise CheckpointError(f"{where}: {e}") from None
        return {TENSOR: table.add(obj)}
    if isinstance(obj, list):
        return [encode(v, table, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {TUPLE: [encode(v, table, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) for k in obj) and not _RESERVED.intersection(obj):
            return {k: encode(v, table, f"{where}[{k!r}]") for k, v in obj.items()}
        return {ITEMS: [[encode(k, table, f"{where} key {k!r}"), encode(v, table, f"{where}[{k!r}]")]
                        for k, v in obj.items()]}
    raise CheckpointError(
        f"{where} holds a {type(obj).__module__}.{type(obj).__qualname__}, which a checkpoint cannot store "
        "without pickle; keep it to dicts, lists, tuples, strings, numbers, booleans, None and tensors"
    )


def _is_numpy_bool(obj: Any) -> bool:
    return type(obj).__module__ == "numpy" and type(obj).__name__ in ("bool", "bool_")


def decode(obj: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of :func:`encode`, with ``tensors`` the table it filled (as read back).

    Raises:
        CheckpointError: a tensor reference or a tuple/items marker is malformed or names no tensor.
    """
    if isinstance(obj, list):
        return [decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if len(obj) == 1 and TENSOR in obj:
            name = obj[TENSOR]
            if not isinstance(name, str) or name not in tensors:
                raise CheckpointError(f"checkpoint metadata refers to a tensor {name!r} that is not stored")
            return tensors[name]
        if len(obj) == 1 and TUPLE in obj:
            return tuple(decode(v, tensors) for v in _marked_list(obj, TUPLE))
        if len(obj) == 1 and ITEMS in obj:
            items = [_marked_list({ITEMS: kv}, ITEMS) for kv in _marked_list(obj, ITEMS)]
            if any(len(kv) != 2 for kv in items):
                raise CheckpointError(f"checkpoint metadata has a malformed {ITEMS} entry: {obj!r:.80}")
            return {_hashable(decode(k, tensors)): decode(v, tensors) for k, v in items}
        return {k: decode(v, tensors) for k, v in obj.items()}
    return obj


def _marked_list(obj: dict[str, Any], marker: str) -> list[Any]:
    if not isinstance(obj[marker], list):
        raise CheckpointError(f"checkpoint metadata has a malformed {marker} entry: {obj!r:.80}")
    return obj[marker]


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        return tuple(_hashable(k) for k in key)
    if isinstance(key, (dict, torch.Tensor)):
        raise CheckpointError(f"checkpoint metadata has a {type(key).__name__} as a dict key")
    return key
