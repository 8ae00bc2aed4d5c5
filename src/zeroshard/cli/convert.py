"""``zeroshard convert``: consolidated safetensors weights from a sharded checkpoint.

``zeroshard convert CHECKPOINT_DIR OUT [--tag TAG] [--dtype fp32|bf16|fp16] [--max-shard-size 5GB]``

``CHECKPOINT_DIR`` holds a zeroshard or DeepSpeed checkpoint (the directory with ``latest``, or a
tag directory); the format is detected from its files. ``OUT`` ending in ``.safetensors`` is the
output file; otherwise it is a directory receiving ``model.safetensors``, or with
``--max-shard-size`` Hugging Face shards plus ``model.safetensors.index.json``. Tensors are read,
cast and written one at a time, so memory stays near the largest tensor. A bad path or an
incomplete checkpoint exits with code 2 and a message naming it.

``zeroshard convert CHECKPOINT_DIR OUT --to deepspeed --world-size N [--stage S] [--dtype D]
[--ds-config ds_config.json]`` writes DeepSpeed 0.19's ZeRO checkpoint layout instead
(``OUT/<tag>/`` and ``OUT/latest``) for a DeepSpeed job of ``N`` ranks at stage ``S`` in
precision ``D``, which ``engine.load_checkpoint(OUT)`` resumes (see
:mod:`zeroshard.checkpoint.to_deepspeed`). Stage, precision and gradient clipping come from the
flags, else from ``--ds-config``, else from the source checkpoint.

``zeroshard convert --hf MODEL_DIR CHECKPOINT_DIR OUT [--dtype D] [--max-shard-size SIZE]`` writes a
``save_pretrained``-style directory that Hugging Face's ``from_pretrained(OUT)`` loads: the weights
(shards and index past the size, 50GB by default) with ``MODEL_DIR``'s ``config.json`` and
generation and tokenizer files (see :mod:`zeroshard.checkpoint.hf_export`).
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
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="dtype of floating-point tensors (default fp32); --to deepspeed: the DeepSpeed job's precision")
    p.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="split into Hugging Face shards of at most SIZE (e.g. 5GB, 500MB, 2GiB)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.add_argument("--to", choices=("safetensors", "deepspeed"), default="safetensors",
                   help="output format (default safetensors; deepspeed: a checkpoint DeepSpeed 0.19 resumes)")
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="--to deepspeed: the DeepSpeed job's ranks")
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=None,
                   help="--to deepspeed: its ZeRO stage (default: --ds-config's, else the checkpoint's)")
    p.add_argument("--ds-config", default=None, metavar="JSON",
                   help="--to deepspeed: its config file (stage, precision, gradient_clipping, sub_group_size)")
    p.add_argument("--hf", default=None, metavar="MODEL_DIR",
                   help="write a Hugging Face save_pretrained directory, with MODEL_DIR's config.json "
                        "(default dtype: the config's)")
    return p


def _to_deepspeed(args: argparse.Namespace, parser: argparse.ArgumentParser, prog: str) -> int:
    """``--to deepspeed``: write DeepSpeed's layout for the job the flags describe."""
    if args.world_size is None or args.world_size < 1:
        parser.error("--to deepspeed needs --world-size N (N >= 1): the number of ranks of the DeepSpeed job")
    import torch

    from zeroshard.checkpoint.open import open_source
    from zeroshard.checkpoint.paths import resolve_checkpoint
    from zeroshard.checkpoint.to_deepspeed import DeepSpeedTarget, load_ds_config, target_from_config
    from zeroshard.checkpoint.to_deepspeed import write_deepspeed_checkpoint as write
    from zeroshard.errors import CheckpointError

    try:
        config = load_ds_config(args.ds_config) if args.ds_config else {}
        path = resolve_checkpoint(args.checkpoint_dir, args.tag)
        if path is None:
            raise CheckpointError(f"{args.checkpoint_dir} has no 'latest' file; pass --tag")
        with open_source(path) as src:
            target = target_from_config(config, args.world_size, src)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype, target.dtype)
        target = DeepSpeedTarget(args.world_size, args.stage or target.stage, dtype, target.gradient_clipping,
                                 target.sub_group_size, config or None)
        final = write(path, args.out, target)
    except (CheckpointError, OSError) as e:
        return _fail(prog, e)
    if not args.quiet:
        print(final)
    return 0


def _to_hf(args: argparse.Namespace, prog: str) -> int:
    """``--hf MODEL_DIR``: a directory ``from_pretrained`` loads."""
    import torch

    from zeroshard.checkpoint.consolidate import parse_size
    from zeroshard.checkpoint.hf_export import export_hf
    from zeroshard.errors import CheckpointError

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype or "")
    try:
        if args.max_shard_size is not None:
            parse_size(args.max_shard_size)
    except ValueError as e:
        print(f"{prog}: error: --max-shard-size: {e}", file=sys.stderr)
        return 2
    try:
        files = export_hf(args.hf, args.checkpoint_dir, args.out, tag=args.tag, dtype=dtype,
                          max_shard_size=args.max_shard_size)
    except (CheckpointError, OSError) as e:
        return _fail(prog, e)
    if not args.quiet:
        for f in files:
            print(f)
    return 0


def _fail(prog: str, error: Exception) -> int:
    """Exit code 2 with the message: an OSError (an output path under a file, no permission, a full
    disk) names its path and cause instead of ending in a traceback."""
    if isinstance(error, OSError) and error.filename is not None:
        error = OSError(f"{error.filename}: {error.strerror}")
    print(f"{prog}: error: {error}", file=sys.stderr)
    return 2


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
        what = "is a file, not a directory" if src.exists() else "does not exist"
        parser.error(f"checkpoint directory {src} {what}")
    out = Path(args.out)
    if out.suffix != ".safetensors" and out.exists() and not out.is_dir():
        parser.error(f"output {out} exists and is not a directory")
    above = next((d for d in out.parents if d.exists()), None)
    if above is not None and not above.is_dir():
        parser.error(f"output {out}: {above} is a file, not a directory")
    if args.to == "deepspeed":
        return _to_deepspeed(args, parser, prog)
    if args.hf is not None:
        return _to_hf(args, prog)
    args.dtype = args.dtype or "fp32"
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
    started = time.perf_counter()
    if not args.quiet:
        print(f"converting {src} to {out} ({args.dtype})", file=sys.stderr, flush=True)
    try:
        files = convert_checkpoint(src, out, tag=args.tag, dtype=dtype, max_shard_size=args.max_shard_size,
                                   progress=update)
    except (CheckpointError, OSError) as e:
        close()
        return _fail(prog, e)
    close()
    if not args.quiet:
        size = sum(Path(f).stat().st_size for f in files if Path(f).is_file())
        print(f"converted {src}: {len(files)} file(s), {size / 2**20:.1f} MiB in {time.perf_counter() - started:.1f} s",
              file=sys.stderr, flush=True)
        for f in files:
            print(f)
    return 0
