"""``zeroshard estimate``: memory per GPU and per node for ZeRO stages 0–3, and a config that fits.

``zeroshard estimate MODEL [options]`` or ``zeroshard estimate --params 7e9 [options]``

MODEL is a Hugging Face ``config.json`` (or a directory holding one, or JSON text) or a factory
``pkg.module:function`` / ``path/file.py:function`` returning an ``nn.Module``; either is built on
the meta device, so no weight is allocated. The table shows model states, buffers, activations
(for transformer configs) with and without activation checkpointing, CPU memory and NVMe swap
files per node, for each stage with and without optimizer and parameter offload. With
``--gpu-memory`` the fastest configuration that fits (without offload, else with CPU offload,
else, given ``--nvme-gb``, with NVMe offload under ``--nvme-path``) is printed as a DeepSpeed
config, or written to ``-o PATH``; when none fits the command says why and exits with 1.
``--offload-ratio R`` adds a stage-3 row with that fraction of the optimizer state offloaded to the
CPU (``offload_optimizer.ratio``), in sub-groups of ``--sub-group-size`` elements.
Bad arguments exit with 2 and a message naming them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zeroshard.estimate.model_spec import ModelSpec

DTYPES = ("bf16", "fp16", "fp32")
#: smallest and largest memory figures taken as plausible (per GPU, or per node for the CPU)
_MEMORY_RANGE = {"--gpu-memory": (16 * 2**20, 64 * 2**40), "--cpu-memory": (16 * 2**20, 1024 * 2**40),
                 "--activation-bytes": (1, 1024 * 2**40)}


def build_parser(prog: str) -> argparse.ArgumentParser:
    """The command's argument parser."""
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Estimate memory per GPU and per node for ZeRO stages 0-3 (with and without CPU and NVMe "
                    "offload), including activations, and optionally write the fastest config that fits.",
        epilog="examples:\n"
               "  zeroshard estimate --params 7e9 --gpus 8\n"
               "  zeroshard estimate path/to/config.json --micro-batch 4 --seq-len 2048 --gpus 8\n"
               "  zeroshard estimate mypkg.models:build --gpus 8 --gpu-memory 80GB --cpu-memory 512GB\n"
               "  zeroshard estimate --params 70e9 --gpus 8 --gpu-memory 24GB --cpu-memory 512GB \\\n"
               "      --nvme-gb 2000 --nvme-path /local_nvme\n"
               "sizes: 80GB = 80e9 bytes, 80GiB = 80*2^30 bytes; counts: 7e9, 7B, 125M.")
    p.add_argument("model", metavar="MODEL", nargs="?",
                   help="Hugging Face config.json, a directory with one, JSON text, or pkg.module:function")
    p.add_argument("--params", metavar="N", help="parameter count instead of MODEL (7e9, 7B, 125M)")
    p.add_argument("--largest-layer", metavar="N",
                   help="with --params: parameters of the largest module (default: 5%% of --params)")
    p.add_argument("--gpus", type=int, default=1, metavar="N", help="GPUs per node (default 1)")
    p.add_argument("--nodes", type=int, default=1, metavar="N", help="nodes (default 1)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="compute dtype (default bf16)")
    p.add_argument("--grad-accum-dtype", choices=DTYPES, default="fp32",
                   help="gradient accumulation dtype, data_types.grad_accum_dtype (default fp32)")
    p.add_argument("--micro-batch", type=int, default=1, metavar="B", help="micro batch per GPU (default 1)")
    p.add_argument("--seq-len", type=int, default=None, metavar="S",
                   help="tokens per sequence (default: 2048, or the model's context if shorter)")
    p.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa",
                   help="attention kernel: sdpa/flash (default) or eager (keeps the s^2 softmax)")
    p.add_argument("--activation-bytes", metavar="SIZE",
                   help="activation memory per GPU for one micro batch, for models without a transformer config")
    p.add_argument("--hpz", type=int, default=1, metavar="H",
                   help="ZeRO++ hpZ's zero_hpz_partition_size: stage 3 rows count its secondary shards (1/H of "
                        "the gathered parameters per GPU); a divisor of --gpus (default 1: off)")
    p.add_argument("--offload-ratio", type=float, metavar="R",
                   help="also show stage 3 with this fraction of the optimizer state offloaded to the CPU "
                        "(offload_optimizer.ratio, ZeRO-Offload++: the first int((1 - R) x sub-groups) stay on "
                        "the GPU); below 1")
    p.add_argument("--sub-group-size", metavar="N",
                   help="with --offload-ratio: zero_optimization.sub_group_size, elements per optimizer "
                        "sub-group (default DeepSpeed's 1e9: a smaller shard is one sub-group, all offloaded)")
    p.add_argument("--gpu-memory", metavar="SIZE", help="memory per GPU: pick the fastest config that fits")
    p.add_argument("--cpu-memory", metavar="SIZE", help="CPU memory per node the config must fit (with --gpu-memory)")
    p.add_argument("--nvme-gb", type=float, metavar="GB",
                   help="NVMe disk per node for swap files, in GB (1e9 bytes): lets the planner choose NVMe "
                        "offload (default: no NVMe)")
    p.add_argument("--nvme-path", metavar="DIR",
                   help="directory on the NVMe drive for swap files, written into the config (needed when the "
                        "chosen plan offloads to NVMe)")
    p.add_argument("--headroom", type=float, default=0.1, metavar="F",
                   help="fraction of GPU memory kept free for the CUDA context and fragmentation (default 0.1)")
    p.add_argument("-o", "--output", default=None, metavar="PATH",
                   help="write the chosen config to PATH (a different file already there is kept unless "
                        "--force); without it the config is printed")
    p.add_argument("--force", action="store_true", help="replace an existing --output file")
    p.add_argument("--deepspeed", action="store_true",
                   help="also print DeepSpeed's own estimator tables (estimate_zero2/3_..._all_cold)")
    return p


def _human(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} bytes"


def parse_memory(text: str, option: str) -> int:
    """``"80GB"`` -> bytes; a bare number, zero or an implausible size is an error naming ``option``."""
    from zeroshard.errors import ConfigError

    if not re.search(r"[a-zA-Z]\s*$", text):
        raise ConfigError(f"{text!r} has no unit; write e.g. 80GB or 80GiB", key=option)
    from zeroshard.checkpoint.consolidate import parse_size

    try:
        n = parse_size(text)
    except ValueError as e:
        raise ConfigError(str(e), key=option) from e
    low, high = _MEMORY_RANGE.get(option, (1, 2**62))
    if not low <= n <= high:
        raise ConfigError(f"{text} is not a plausible size here (between {_human(low)} and {_human(high)})",
                          key=option)
    return n


def _spec(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ModelSpec:
    from zeroshard.estimate.model_spec import parse_count, spec_from_count, spec_from_factory

    if args.params is not None:
        if args.model is not None:
            parser.error("give MODEL or --params, not both")
        largest = parse_count(args.largest_layer, "--largest-layer") if args.largest_layer else None
        return spec_from_count(parse_count(args.params), largest)
    if args.model is None:
        parser.error("give MODEL (a Hugging Face config or pkg.module:function) or --params N")
    if args.largest_layer is not None:
        parser.error("--largest-layer goes with --params (a built model's largest layer is measured)")
    model: str = args.model
    looks_like_factory = ":" in model and not model.lstrip().startswith("{") and not Path(model).exists()
    if looks_like_factory:
        return spec_from_factory(model)
    from zeroshard.estimate.hf import spec_from_hf_config

    return spec_from_hf_config(model)


def _sub_group_size(text: str | None) -> int | None:
    """``--sub-group-size`` as a count of at least 1 (``None`` when not given)."""
    if text is None:
        return None
    from zeroshard.estimate.model_spec import parse_count

    return parse_count(text, "--sub-group-size")  # at least 1


def _check_numbers(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for option, value in (("--gpus", args.gpus), ("--nodes", args.nodes), ("--micro-batch", args.micro_batch),
                          ("--seq-len", args.seq_len)):
        if value is not None and value < 1:
            parser.error(f"argument {option}: must be at least 1, got {value}")
    if args.hpz < 1 or args.gpus % args.hpz:
        parser.error(f"argument --hpz: must divide the {args.gpus} GPUs of a node (--gpus), got {args.hpz}")
    if not 0 <= args.headroom < 1:
        parser.error(f"argument --headroom: must be in [0, 1), got {args.headroom}")
    for option, value in (("--cpu-memory", args.cpu_memory), ("--nvme-gb", args.nvme_gb),
                          ("--nvme-path", args.nvme_path)):
        if value is not None and args.gpu_memory is None:
            parser.error(f"argument {option}: only used with --gpu-memory (planning)")
    if args.nvme_gb is not None and not 0 < args.nvme_gb < 1e9:
        parser.error(f"argument --nvme-gb: must be a number of GB above 0, got {args.nvme_gb:g}")
    if args.offload_ratio is not None and not 0 <= args.offload_ratio < 1:
        parser.error(f"argument --offload-ratio: must be in [0, 1) (1 offloads all of it: the optimizer->cpu row), "
                     f"got {args.offload_ratio:g}")
    if args.sub_group_size is not None and args.offload_ratio is None:
        parser.error("argument --sub-group-size: only used with --offload-ratio")
    if args.nvme_path is not None and args.nvme_gb is None:
        parser.error("argument --nvme-path: give the disk budget per node with --nvme-gb too "
                     "(NVMe offload is considered only with a budget)")


def main(argv: Sequence[str], prog: str = "zeroshard estimate") -> int:
    """Run the command; returns the exit code (0, 1 when nothing fits, 2 for bad arguments)."""
    parser = build_parser(prog)
    args = parser.parse_args(list(argv))
    _check_numbers(args, parser)
    from zeroshard.errors import ConfigError

    try:
        gpu_memory = parse_memory(args.gpu_memory, "--gpu-memory") if args.gpu_memory else None
        cpu_memory = parse_memory(args.cpu_memory, "--cpu-memory") if args.cpu_memory else None
        activation_bytes = parse_memory(args.activation_bytes, "--activation-bytes") if args.activation_bytes else None
        sub_group_size = _sub_group_size(args.sub_group_size)
        spec = _spec(args, parser)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2

    from zeroshard.estimate.planner import Hardware, PlanError, Training, estimate, plan
    from zeroshard.estimate.table import render_estimate, render_plan

    notes = []
    seq_len = args.seq_len
    max_pos = spec.transformer.max_positions if spec.transformer else None
    if seq_len is None:
        seq_len = min(2048, max_pos) if isinstance(max_pos, int) and max_pos > 0 else 2048
    elif isinstance(max_pos, int) and seq_len > max_pos:
        notes.append(f"note: --seq-len {seq_len} exceeds the model's max_position_embeddings ({max_pos})")
    nvme_memory = int(args.nvme_gb * 1e9) if args.nvme_gb is not None else None
    hardware = Hardware(args.gpus, args.nodes, gpu_memory, cpu_memory, nvme_memory)
    training = Training(args.dtype, args.grad_accum_dtype, args.micro_batch, seq_len, args.attention, activation_bytes,
                        hpz_partition_size=args.hpz)
    print(render_estimate(estimate(spec, hardware, training, args.offload_ratio, sub_group_size)))
    for n in notes:
        print(n)
    if args.deepspeed:
        from zeroshard.estimate import formulas

        print()
        formulas.estimate_zero2_model_states_mem_needs_all_cold(spec.total_params, args.gpus, args.nodes)
        print()
        formulas.estimate_zero3_model_states_mem_needs_all_cold(spec.total_params, spec.largest_layer_params,
                                                                args.gpus, args.nodes)
    if gpu_memory is None:
        return 0
    print()
    try:
        chosen = plan(spec, hardware, training, args.headroom, args.nvme_path)
    except PlanError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    text = json.dumps(chosen.config, indent=2) + "\n"
    if args.output is None:  # nothing written unless asked: the working directory is often the user's project
        print(render_plan(chosen, None))
        print(text, end="")
        return 0
    out = Path(args.output)
    if out.is_file() and not args.force and out.read_text(errors="replace") != text:
        # -o often names the user's own ds_config.json: never overwritten by surprise.
        print(render_plan(chosen, None))
        print(f"{prog}: error: {out} exists and holds another config: kept. Pass -o PATH to write the chosen "
              "config elsewhere, or --force to replace it", file=sys.stderr)
        return 2
    try:
        out.write_text(text)
    except OSError as e:
        print(f"{prog}: error: cannot write {out}: {e}", file=sys.stderr)
        return 2
    print(render_plan(chosen, str(out)))
    if chosen.row.choice.uses_nvme and not Path(args.nvme_path).is_dir():
        print(f"note: --nvme-path {args.nvme_path} is not a directory yet: create it before training")
    return 0
