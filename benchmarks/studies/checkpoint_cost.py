"""Checkpoint benchmark: zeroshard vs DeepSpeed on the same model, 2 CPU ranks (gloo).

    python benchmarks/studies/checkpoint_cost.py [--layers 6] [--width 2048] [--stage 2] [--reps 3]

Model: ``layers`` Linear(width, width) layers (default 6 × 2048²: 25.2M parameters), fp32, AdamW
after one training step (so Adam state exists), ZeRO stage 2 on both systems. Measured:

- save: ``engine.save_checkpoint`` (zeroshard fsyncs every file; DeepSpeed's ``torch.save`` does not,
  so a "save + fsync" row times DeepSpeed's save followed by an fsync of the files each rank wrote);
- load: ``engine.load_checkpoint`` of that checkpoint into the same engine;
- convert: consolidated fp32 safetensors, in a fresh subprocess: ``zeroshard convert`` vs
  DeepSpeed's ``zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(safe_serialization=True)``,
  plus ``zeroshard convert`` of the DeepSpeed checkpoint.

Every save goes to a new tag, as in training. Times are medians over ``--reps`` (page cache warm:
each load reads the files just written). Memory is the peak resident memory *added* by the
operation (``/proc/self/clear_refs`` resets the peak mark just before it), the largest over ranks.
Writes only under a temporary directory (about 3.5 GB with 5 reps); prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MiB = 2**20


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _measure(fn: Any) -> tuple[float, int]:
    """(seconds, peak resident bytes added) of ``fn()``."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = _status("VmRSS")
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t, _status("VmHWM") - start


def _engine(system: str, layers: int, width: int, stage: int) -> Any:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 10**9}
    if system == "deepspeed":
        import deepspeed as lib

        cfg["optimizer"]["params"]["torch_adam"] = True
    else:
        import zeroshard as lib
    engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    loss = engine(torch.randn(4, width)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return engine


def _fsync_own(tag_dir: str, rank: int) -> None:
    """fsync the files this DeepSpeed rank wrote, and the directory."""
    tag = Path(tag_dir)
    for f in tag.iterdir():
        if f"rank_{rank}_" in f.name or (rank == 0 and f.name.startswith("mp_rank_")):
            fd = os.open(f, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    fd = os.open(tag, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def _rank(rank: int, world: int, args: argparse.Namespace, system: str, root: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{root}/store-{system}", rank=rank, world_size=world)
    engine = _engine(system, args.layers, args.width, args.stage)
    ckpt = f"{root}/{system}"
    out: dict[str, list[float]] = {"save_s": [], "save_rss": [], "load_s": [], "load_rss": []}
    for i in range(args.reps):
        tag = f"bench{i}"  # a new tag each time, as in training (global_step<N>): nothing is replaced
        ops = [("save", lambda tag=tag: engine.save_checkpoint(ckpt, tag=tag)),
               ("load", lambda tag=tag: engine.load_checkpoint(ckpt, tag=tag))]
        if system == "deepspeed":  # torch.save does not fsync; this row makes it as durable as zeroshard's
            out.setdefault("save_fsync_s", [])
            out.setdefault("save_fsync_rss", [])
            ops.append(("save_fsync", lambda tag=tag: (engine.save_checkpoint(ckpt, tag=tag + "f"),
                                                       _fsync_own(f"{ckpt}/{tag}f", rank))))
        for op, fn in ops:
            dist.barrier()
            seconds, rss = _measure(lambda fn=fn: (fn(), dist.barrier()))
            both = torch.tensor([seconds, float(rss)], dtype=torch.float64)
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
            out[f"{op}_s"].append(float(both[0]))
            out[f"{op}_rss"].append(float(both[1]))
    if rank == 0:
        Path(f"{root}/{system}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


CONVERT = """
import json, sys, time
sys.path.insert(0, {bench!r})
from checkpoint_cost import _measure
kind, src, out = sys.argv[1:4]
if kind == "deepspeed":
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as convert
    run = lambda: convert(src, out, safe_serialization=True, tag="bench0")
else:
    from zeroshard.checkpoint.consolidate import convert_checkpoint
    run = lambda: convert_checkpoint(src, out + "/model.safetensors", tag="bench0")
seconds, rss = _measure(run)
print(json.dumps({{"s": seconds, "rss": rss}}))
"""


def _convert(kind: str, src: str, out: str, reps: int) -> dict[str, float]:
    """Median time and peak-RSS increase of ``reps`` conversions, each in a fresh process."""
    runs = []
    for _ in range(reps):
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        code = CONVERT.format(bench=str(Path(__file__).resolve().parent))
        proc = subprocess.run([sys.executable, "-c", code, kind, src, out], capture_output=True, text=True, check=True)
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(r[k] for r in runs) for k in ("s", "rss")}


def _size(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file() and not f.name.endswith(".py"))


def main(argv: list[str] | None = None) -> int:
    """Run both systems and print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    root = tempfile.mkdtemp(prefix="zeroshard-ckpt-bench-")
    try:
        rows: dict[str, dict[str, Any]] = {}
        for system in ("zeroshard", "deepspeed"):
            mp.start_processes(_rank, args=(2, args, system, root), nprocs=2, start_method="spawn")
            rows[system] = json.loads(Path(f"{root}/{system}.json").read_text())
            rows[system]["size"] = _size(f"{root}/{system}/bench0")
        jobs = {"zeroshard": ("zeroshard", "zeroshard"), "deepspeed (zero_to_fp32)": ("deepspeed", "deepspeed"),
                "zeroshard, of the DeepSpeed checkpoint": ("zeroshard", "deepspeed")}
        conversions = {label: _convert(kind, f"{root}/{src}", f"{root}/out-{i}", args.reps)
                       for i, (label, (kind, src)) in enumerate(jobs.items())}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    numel = args.layers * (args.width * args.width + args.width)
    print(f"\n{numel / 1e6:.1f}M fp32 parameters, AdamW, ZeRO stage {args.stage}, 2 CPU ranks; "
          f"median of {args.reps}; memory = peak RSS added by the operation (max over ranks)\n")
    print("| operation | system | time (s) | peak RSS added (MiB) | checkpoint on disk (MiB) |")
    print("|---|---|---:|---:|---:|")
    for op in ("save", "save_fsync", "load"):
        for system, r in rows.items():
            if op + "_s" in r:
                label = "save + fsync" if op == "save_fsync" else op
                print(f"| {label} | {system} | {statistics.median(r[op + '_s']):.3f} | "
                      f"{statistics.median(r[op + '_rss']) / MiB:.1f} | {r['size'] / MiB:.0f} |")
    for system, c in conversions.items():
        print(f"| convert to fp32 safetensors | {system} | {c['s']:.3f} | {c['rss'] / MiB:.1f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
