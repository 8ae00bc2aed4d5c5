"""Random number generator states of one rank: torch (CPU and CUDA), Python's ``random``, NumPy.

Captured as tensors (saved in the rank's safetensors file) plus a small JSON record, and
restored exactly, so dropout masks and data shuffles after a resume equal an uninterrupted run's.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch

try:  # NumPy is optional
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]


def capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This process's generator states: ``(tensors, json_record)``."""
    tensors: dict[str, torch.Tensor] = {"rng/torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{i}"] = state
    version, internal, gauss = random.getstate()
    record: dict[str, Any] = {"python": [version, list(internal), gauss]}
    if np is not None:
        np_state: Any = np.random.get_state()
        kind, keys, pos, has_gauss, cached = np_state
        tensors["rng/numpy"] = torch.from_numpy(keys.astype(np.int64))
        record["numpy"] = [kind, int(pos), int(has_gauss), float(cached)]
    return tensors, record


def restore_rng(tensors: Mapping[str, torch.Tensor], record: Mapping[str, Any]) -> None:
    """Restore the states :func:`capture_rng` returned (what is absent is left as it is)."""
    if "rng/torch" in tensors:
        torch.set_rng_state(tensors["rng/torch"].to(torch.uint8))
    cuda = sorted((k for k in tensors if k.startswith("rng/cuda/")), key=lambda k: int(k.rsplit("/", 1)[1]))
    if cuda and torch.cuda.is_available():
        for key in cuda[: torch.cuda.device_count()]:
            torch.cuda.set_rng_state(tensors[key].to(torch.uint8), device=int(key.rsplit("/", 1)[1]))
    if "python" in record:
        version, internal, gauss = record["python"]
        random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    if np is not None and "numpy" in record and "rng/numpy" in tensors:
        kind, pos, has_gauss, cached = record["numpy"]
        keys = tensors["rng/numpy"].numpy().astype(np.uint32)
        np.random.set_state((kind, keys, int(pos), int(has_gauss), float(cached)))
