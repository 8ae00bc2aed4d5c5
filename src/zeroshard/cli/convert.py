"""``zeroshard convert``: consolidated safetensors weights from a sharded checkpoint.

``zeroshard convert CHECKPOINT_DIR OUT [--tag TAG] [--dtype fp32|bf16|fp16] [--max-shard-size 5GB]``

``CHECKPOINT_DIR`` holds a zeroshard or DeepSpeed checkpoint (the directory with ``latest``, or a
tag directory); the format is detected from its files. ``OUT`` ending in ``.safetensors`` is the
output file; otherwise it is a directory receiving ``model.safetensors``, or with
``--max-shard-size`` Hugging Face shards plus ``model.safetensors.index.json``. Tensors are read,
cast and written one at a time, so memory stays near the largest tensor. A bad path or an
incomplete checkpoint exits with code 2 and a message naming it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

DTYPES = ("fp32", "bf16", "fp16")


def build_parser(prog: str) -> argparse.ArgumentParser:
    """The command's argument parser."""
    p = argparse.ArgumentParser(prog=prog, description="Write a checkpoint's consolidated weights as safetensors.")
    p.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR", help="zeroshard or DeepSpeed checkpoint directory")
    p.add_argument("out", metavar="OUT", help="output .safetensors file, or a directory")
    p.add_argument("--tag", default=None, help="tag to convert (default: the one named by CHECKPOINT_DIR/latest)")
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="dtype of floating-point tensors (default fp32)")
    p.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="split into Hugging Face shards of at most SIZE (e.g. 5GB, 500MB, 2GiB)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    return p


def _progress(quiet: bool) -> tuple[Callable[[int, int, str], None] | None, Callable[[], None]]:
    if quiet:
        return None, lambda: None
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    bar = None
    last = [0.0]

    def update(done: int, total: int, name: str) -> None:
        nonlocal bar
        if tqdm is not None:
            if bar is None:
                bar = tqdm(total=total, unit="tensor", desc="converting", file=sys.stderr)
            bar.update(1)
        elif time.monotonic() - last[0] > 5 or done == total:
            last[0] = time.monotonic()
            print(f"converting: {done}/{total} tensors ({name})", file=sys.stderr, flush=True)

    return update, lambda: bar.close() if bar is not None else None


def main(argv: Sequence[str], prog: str = "zeroshard convert") -> int:
    """Run the command; returns the exit code."""
    parser = build_parser(prog)
    args = parser.parse_args(list(argv))
    for name in ("checkpoint_dir", "out"):
        if not isinstance(getattr(args, name), str):  # argparse before 3.12 turns a lone "--" into []
            parser.error(f"the following arguments are required: {name.upper()}")
    src = Path(args.checkpoint_dir)
    if not src.is_dir():
        parser.error(f"checkpoint directory {src} does not exist")
    out = Path(args.out)
    if out.suffix != ".safetensors" and out.exists() and not out.is_dir():
        parser.error(f"output {out} exists and is not a directory")
    if args.max_shard_size is not None:
        from zeroshard.checkpoint.consolidate import parse_size

        try:
            parse_size(args.max_shard_size)
        except ValueError as e:
            parser.error(str(e))

    import torch

    from zeroshard.checkpoint.consolidate import convert_checkpoint
    from zeroshard.errors import CheckpointError

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    update, close = _progress(args.quiet)
    try:
        files = convert_checkpoint(src, out, tag=args.tag, dtype=dtype, max_shard_size=args.max_shard_size,
                                   progress=update)
    except CheckpointError as e:
        close()
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    close()
    if not args.quiet:
        for f in files:
            print(f)
    return 0
