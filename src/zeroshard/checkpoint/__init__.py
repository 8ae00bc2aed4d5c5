"""Checkpoints: sharded, crash-safe, reshardable, with consolidated export and DeepSpeed import.

- :mod:`~zeroshard.checkpoint.metadata`: the on-disk format (per-rank safetensors + JSON).
- :mod:`~zeroshard.checkpoint.save` / :mod:`~zeroshard.checkpoint.load`: ``engine.save_checkpoint``
  and ``engine.load_checkpoint``; any world size and stage on either side.
- :mod:`~zeroshard.checkpoint.consolidate`: full fp32 state dicts and streaming safetensors export
  (``zeroshard convert``).
- :mod:`~zeroshard.checkpoint.deepspeed` and :mod:`~zeroshard.checkpoint.unpickle`: reading
  DeepSpeed 0.19 ZeRO checkpoints without DeepSpeed and without running pickle code.
- :mod:`~zeroshard.checkpoint.to_deepspeed` and :mod:`~zeroshard.checkpoint.ds_pickle`: writing
  DeepSpeed's layout (``zeroshard convert --to deepspeed``).
- :mod:`~zeroshard.checkpoint.atomic`, :mod:`~zeroshard.checkpoint.paths`,
  :mod:`~zeroshard.checkpoint.tags`: crash safety, tags, ``tag_validation``, ``zero_to_fp32.py``.
- :mod:`~zeroshard.checkpoint.dataloader`: the resumable data loader ``initialize`` returns.

Submodules are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "save_checkpoint": "zeroshard.checkpoint.save",
    "load_checkpoint": "zeroshard.checkpoint.load",
    "get_fp32_state_dict_from_zero_checkpoint": "zeroshard.checkpoint.consolidate",
    "load_state_dict_from_zero_checkpoint": "zeroshard.checkpoint.consolidate",
    "convert_checkpoint": "zeroshard.checkpoint.consolidate",
    "open_source": "zeroshard.checkpoint.open",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'zeroshard.checkpoint' has no attribute {name!r}")
