"""Consolidated weights from a sharded checkpoint (zeroshard's or DeepSpeed's), tensor by tensor.

:func:`convert_checkpoint` writes one safetensors file, or Hugging Face style shards
(``model-00001-of-00003.safetensors`` + ``model.safetensors.index.json``) when a maximum shard
size is given. It plans every file's header from the checkpoint metadata, then fetches, casts and
writes one tensor at a time, so peak memory is about the largest tensor, not the model. Tied
parameters are written once, under their first name (as Hugging Face does); buffers and frozen
parameters are included. The Python functions mirror DeepSpeed's ``zero_to_fp32`` helpers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from zeroshard.checkpoint.atomic import new_nonce
from zeroshard.checkpoint.open import open_source
from zeroshard.checkpoint.paths import resolve_checkpoint
from zeroshard.checkpoint.safetensors_io import TensorSpec, write_safetensors
from zeroshard.checkpoint.source import CheckpointSource
from zeroshard.core.partition import consecutive_runs
from zeroshard.errors import CheckpointError

logger = logging.getLogger("zeroshard")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
#: Weight files of a ``save_pretrained``-style directory: a previous export's are replaced, not kept beside.
_EXPORT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5·10⁹ bytes, ``"500MiB"`` -> 500·2²⁰, ``123`` -> 123 (Hugging Face's convention)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"cannot read size {text!r}; write e.g. 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def open_checkpoint(checkpoint_dir: str | Path, tag: str | None) -> CheckpointSource:
    """The checkpoint at ``checkpoint_dir`` (``tag``, or the one ``latest`` names), opened for reading."""
    path = resolve_checkpoint(checkpoint_dir, tag)
    if path is None:
        if not Path(checkpoint_dir).exists():
            raise CheckpointError(f"checkpoint directory {checkpoint_dir} does not exist")
        raise CheckpointError(f"{checkpoint_dir} has no 'latest' file; pass the tag (a subdirectory) explicitly")
    return open_source(path)


def export_names(src: CheckpointSource) -> list[str]:
    """Tensors to export, in the module's ``state_dict`` order, each tied parameter once."""
    known = set(src.params) | set(src.frozen) | set(src.buffers)
    ordered = [k for k in src.module_keys if k in known]
    return ordered + [k for k in (*src.params, *src.frozen, *src.buffers) if k not in set(ordered)]


def _spec(src: CheckpointSource, name: str, dtype: torch.dtype | None) -> TensorSpec:
    if name in src.params:
        return TensorSpec(name, dtype or torch.float32, tuple(src.params[name].shape))
    t = src.read_extra(name)  # buffers and frozen parameters are small next to the trained ones
    out = (dtype or torch.float32) if t.is_floating_point() else t.dtype
    return TensorSpec(name, out, tuple(t.shape))


def iter_consolidated(src: CheckpointSource, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for every exported tensor, one at a time (floating point in ``dtype``, fp32 default)."""
    for name in export_names(src):
        t = src.read_full(name)
        yield name, t.to(dtype or torch.float32) if t.is_floating_point() else t


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | Path, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The full fp32 state dict of a zeroshard or DeepSpeed ZeRO checkpoint, on CPU.

    Args:
        checkpoint_dir: the directory holding ``latest`` and the tag directories (or a tag directory).
        tag: the tag to read; default: the one named by ``checkpoint_dir/latest``.
        exclude_frozen_parameters: leave out parameters that were not trained.
        lazy_mode: accepted for DeepSpeed's signature; tensors are returned materialized (their
            ``.contiguous()``, which DeepSpeed's lazy tensors need, works on them as well).

    Returns:
        Parameter and buffer names (tied parameters under every name, as DeepSpeed's) to tensors,
        ready for ``model.load_state_dict``.
    """
    del lazy_mode
    with open_checkpoint(checkpoint_dir, tag) as src:
        skip = set(src.frozen) if exclude_frozen_parameters else set()
        out = {name: t for name, t in iter_consolidated(src) if name not in skip}
        for alias, name in src.aliases.items():
            if name in out:
                out[alias] = out[name]
        order = {k: i for i, k in enumerate(src.module_keys)}
    return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str | Path,
                                         tag: str | None = None) -> torch.nn.Module:
    """Load a checkpoint's consolidated fp32 weights into ``model`` (moved to CPU), as DeepSpeed does.

    Returns the model. Keys absent from the checkpoint are left as they are (``strict=False``).
    """
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def _plan(specs: list[TensorSpec], max_bytes: int | None) -> list[list[TensorSpec]]:
    limit = max_bytes if max_bytes is not None else sys.maxsize
    return consecutive_runs(specs, lambda s: s.nbytes, limit) or [[]]


def _remove_previous_export(out: Path, written: list[Path]) -> None:
    """Delete weight files of an earlier export into ``out`` that this one did not write.

    ``from_pretrained`` prefers ``model.safetensors`` to an index, so a single file left from a
    previous export beside new shards would load the old weights. Runs only once the new files are
    complete, so a failed export leaves the previous one whole.
    """
    keep = {p.name for p in written}
    for path in sorted(out.iterdir()):
        if path.name not in keep and _EXPORT_FILE.fullmatch(path.name) and path.is_file():
            logger.warning("removing %s, left by a previous export into %s", path.name, out)
            path.unlink()


def convert_checkpoint(checkpoint_dir: str | Path, out: str | Path, tag: str | None = None,
                       dtype: torch.dtype = torch.float32, max_shard_size: str | int | None = None,
                       progress: Callable[[int, int, str], None] | None = None) -> list[Path]:
    """Write a checkpoint's consolidated weights as safetensors; return the files written.

    ``out`` ending in ``.safetensors`` is the single output file; otherwise it is a directory that
    receives ``model.safetensors``, or, with ``max_shard_size``, Hugging Face shards and index.
    Every file is written under a temporary name and renamed once all are complete, so a failure
    leaves nothing behind; then weight files of a previous export into the same directory
    (``model.safetensors``, shards, index) that this one did not write are removed, as
    ``save_pretrained`` removes stale shards. ``progress(done, total, name)`` is called after each tensor.
    """
    out = Path(out)
    limit = None if max_shard_size is None else parse_size(max_shard_size)
    with open_checkpoint(checkpoint_dir, tag) as src:
        specs = [_spec(src, n, dtype) for n in export_names(src)]
        shards = _plan(specs, limit)
        if out.suffix == ".safetensors":
            if len(shards) > 1:
                raise CheckpointError(f"{out}: --max-shard-size needs an output directory, not a .safetensors file")
            files = [out]
        else:
            files = [out / (SINGLE_FILE if len(shards) == 1 else
                            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors") for i in range(len(shards))]
        made_dir = not files[0].parent.exists()
        files[0].parent.mkdir(parents=True, exist_ok=True)
        done, total = 0, len(specs)

        def produce(spec: TensorSpec) -> torch.Tensor:
            nonlocal done
            t = src.read_full(spec.name)
            done += 1
            if progress is not None:
                progress(done, total, spec.name)
            return t.to(spec.dtype)

        meta: dict[str, Any] = {"format": "pt", "source": str(src.path), "source_format": src.format}
        tmps: list[Path] = []
        try:  # every file under a temporary name first: a failure leaves no output behind
            for path, shard in zip(files, shards):
                tmps.append(path.with_name(f".tmp-{path.name}-{new_nonce()}"))
                write_safetensors(tmps[-1], shard, produce, {k: str(v) for k, v in meta.items()})
        except BaseException:
            for tmp in tmps:
                tmp.unlink(missing_ok=True)
            if made_dir:
                with contextlib.suppress(OSError):
                    files[0].parent.rmdir()
            raise
        for tmp, path in zip(tmps, files):
            os.replace(tmp, path)
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
                     "weight_map": {s.name: f.name for f, shard in zip(files, shards) for s in shard}}
            (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
            files.append(out / INDEX_FILE)
        if out.suffix != ".safetensors":
            _remove_previous_export(out, files)
    logger.info("wrote %d tensors to %s", total, ", ".join(str(f) for f in files))
    return files
