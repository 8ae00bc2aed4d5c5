"""DeepSpeed's ``zero_to_fp32``, for zeroshard and DeepSpeed ZeRO checkpoints alike.

``python -m zeroshard.deepspeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization]
[--max_shard_size 5GB] [--exclude_frozen_parameters]`` takes DeepSpeed's flags and writes its file
names: ``pytorch_model.bin`` (a ``torch.save`` state dict), or ``model.safetensors`` with
``--safe_serialization``; past ``--max_shard_size``, Hugging Face shards
(``pytorch_model-00001-of-00002.bin`` ...) and an index (``pytorch_model.bin.index.json``).
Tensors are read one at a time and written one shard at a time. Every saved checkpoint folder
holds a ``zero_to_fp32.py`` that runs this module, as DeepSpeed's do.

The Python functions take DeepSpeed's arguments. Checkpoints are read without unpickling
anything (zeroshard's are safetensors; DeepSpeed's pickles go through a restricted reader), so
converting a checkpoint from elsewhere runs none of its code.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from zeroshard.checkpoint.atomic import new_nonce
from zeroshard.checkpoint.consolidate import (
    _plan,
    _spec,
    export_names,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
    open_checkpoint,
    parse_size,
)
from zeroshard.checkpoint.safetensors_io import TensorSpec, write_safetensors

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "convert_zero_checkpoint_to_state_dict",
           "get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint", "main"]

logger = logging.getLogger("zeroshard")
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower().replace("torch.", "") in _DTYPES:
        return _DTYPES[dtype.lower().replace("torch.", "")]
    raise ValueError(f"unsupported output dtype {dtype!r}: use float32, bfloat16 or float16")


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


def convert_zero_checkpoint_to_state_dict(checkpoint_dir: str | Path, output_dir: str | Path,
                                          dtype: torch.dtype | str = torch.float32,
                                          max_shard_size: str | int | None = "5GB",
                                          safe_serialization: bool = False, tag: str | None = None,
                                          exclude_frozen_parameters: bool = False) -> list[Path]:
    """Write the consolidated state dict into ``output_dir`` under DeepSpeed's file names; return the files.

    ``pytorch_model.bin`` (``torch.save``) or ``model.safetensors`` (``safe_serialization``);
    past ``max_shard_size`` (``None``: never), numbered shards and an index file. Floating-point
    tensors are cast to ``dtype``; others keep theirs. With safetensors a tied parameter is
    written once (safetensors cannot store shared tensors); ``.bin`` files keep every name.
    """
    dtype = _dtype(dtype)
    limit = None if max_shard_size is None else parse_size(max_shard_size)
    out = Path(output_dir)
    weights = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    with open_checkpoint(checkpoint_dir, tag) as src:
        skip = set(src.frozen) if exclude_frozen_parameters else set()
        specs = [_spec(src, n, dtype) for n in export_names(src) if n not in skip]
        shards = _plan(specs, limit)
        stem, ext = weights.rsplit(".", 1)
        files = [out / (weights if len(shards) == 1 else f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}")
                 for i in range(len(shards))]
        aliases = {} if safe_serialization else {a: n for a, n in src.aliases.items() if n not in skip}
        out.mkdir(parents=True, exist_ok=True)
        tmps: list[Path] = []
        try:  # every file under a temporary name first: a failure leaves no partial output
            for path, shard in zip(files, shards):
                tmps.append(path.with_name(f".tmp-{path.name}-{new_nonce()}"))
                if safe_serialization:
                    write_safetensors(tmps[-1], shard, lambda s: _as(src.read_full(s.name), s.dtype), {"format": "pt"})
                else:
                    _write_bin(tmps[-1], shard, aliases, lambda s: _as(src.read_full(s.name), s.dtype))
        except BaseException:
            for tmp in tmps:
                tmp.unlink(missing_ok=True)
            raise
        for tmp, path in zip(tmps, files):
            os.replace(tmp, path)
        if len(files) > 1:
            weight_map = {s.name: f.name for f, shard in zip(files, shards) for s in shard}
            weight_map.update({a: weight_map[n] for a, n in aliases.items() if n in weight_map})
            index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": weight_map}
            files.append(out / f"{weights}.index.json")
            files[-1].write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    logger.info("wrote %s", ", ".join(str(f) for f in files))
    return files


def _write_bin(path: Path, shard: list[TensorSpec], aliases: dict[str, str], read: Any) -> None:
    state = {s.name: read(s) for s in shard}
    state.update({a: state[n] for a, n in aliases.items() if n in state})  # shared storage, as state_dict()
    torch.save(state, path)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | Path, output_dir: str | Path,
                                               max_shard_size: str | int | None = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> list[Path]:
    """:func:`convert_zero_checkpoint_to_state_dict` in fp32 (DeepSpeed's name and defaults)."""
    return convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, torch.float32, max_shard_size,
                                                 safe_serialization, tag, exclude_frozen_parameters)


def build_parser(prog: str = "zero_to_fp32.py", with_dtype: bool = False) -> argparse.ArgumentParser:
    """DeepSpeed's ``zero_to_fp32.py`` arguments (with ``with_dtype``: ``zero_to_torch.py``'s, which
    add a required ``--dtype``)."""
    what = "fp32, fp16 or bf16" if with_dtype else "fp32"
    p = argparse.ArgumentParser(prog=prog, description=f"Consolidate a ZeRO checkpoint into {what} weights.")
    p.add_argument("checkpoint_dir", help="the checkpoint folder (holding 'latest' and the tag folders)")
    p.add_argument("output_dir", help="directory receiving the state dict files")
    if with_dtype:
        p.add_argument("--dtype", required=True, choices=sorted(_DTYPES), help="output tensor dtype")
    p.add_argument("--max_shard_size", default="5GB", help="largest shard, e.g. 5GB or 500MB (default 5GB)")
    p.add_argument("--safe_serialization", action="store_true", help="write safetensors instead of torch.save files")
    p.add_argument("-t", "--tag", default=None, help="checkpoint tag, e.g. global_step1 (default: from 'latest')")
    p.add_argument("--exclude_frozen_parameters", action="store_true", help="exclude frozen parameters")
    p.add_argument("-d", "--debug", action="store_true", help="log debug messages")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "zero_to_fp32.py", with_dtype: bool = False) -> int:
    """Run the command; returns the exit code (2 for a bad checkpoint or argument)."""
    from zeroshard.errors import CheckpointError

    parser = build_parser(prog, with_dtype)
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO, format="%(message)s")
    try:
        parse_size(args.max_shard_size)
    except ValueError as e:
        parser.error(str(e))
    try:
        files = convert_zero_checkpoint_to_state_dict(args.checkpoint_dir, args.output_dir,
                                                      getattr(args, "dtype", "fp32"), args.max_shard_size,
                                                      args.safe_serialization, args.tag,
                                                      args.exclude_frozen_parameters)
    except CheckpointError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    for f in files:
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m zeroshard.deepspeed.utils.zero_to_fp32"))
