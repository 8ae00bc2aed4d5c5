"""Activation memory with and without activation checkpointing (zeroshard.checkpointing).

    python benchmarks/studies/activation_memory.py [--layers 8] [--dim 256] [--seq 256] [--batch 2] [--world 2]

A decoder-style model (pre-norm blocks: SDPA attention + 4x MLP, dropout 0.1), fp32, one training
step per row after a warm-up step. Rows: no checkpointing; one checkpoint per block; plus
``cpu_checkpointing``; plus ``partition_activations`` over a model-parallel group of ``--world``
ranks (every rank gets the same batch, as tensor-parallel ranks do). Measured per rank:

- saved: bytes held for backward when forward ends: the tensors autograd saved (distinct storages,
  weights excluded, seen by an outer ``saved_tensors_hooks``) plus the checkpointed inputs zeroshard
  holds (``zeroshard.activations.STATS``), shown on their own with the part in host memory (all of
  it on a CPU run, where ``cpu_checkpointing`` has nothing to move);
- CPU peak: the peak of live bytes in torch's CPU allocator over forward + backward (profiler
  memory events; RSS would hide it, glibc keeps freed pages);
- CUDA peak (``--device cuda``): ``torch.cuda.max_memory_allocated`` over forward + backward, minus
  what was allocated before (weights, gradients);
- peak RSS (CPU): the growth of the rank's resident memory (``VmHWM``) over the mode's timed
  steps, what the process really holds. Each mode runs in fresh rank processes, so none inherits
  another's heap, and warms up on a 1 × 8-token batch (code paths loaded, gradients allocated,
  little heap left behind). Start with ``MALLOC_MMAP_THRESHOLD_=131072`` for figures that do not
  depend on when glibc raises its mmap threshold (README, "Memory"; the report names the setting);
- step: wall time of forward + backward (median of 3), indicative only on a shared machine.

The CPU run spawns ``--world`` gloo ranks per mode; the CUDA run is one process (partitioning needs
a group of several devices) and writes ``activation_memory-cuda.md``. Prints a Markdown table and
writes it to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.harness import proc_memory  # noqa: E402
from benchmarks.harness.machine import allocator_settings, allocator_text  # noqa: E402

MiB = 2**20
MODES = ("plain", "checkpoint", "checkpoint + cpu_checkpointing", "checkpoint + partition_activations")


def modes_for(world: int) -> tuple[str, ...]:
    """The modes a run of ``world`` ranks measures (partitioning needs a group of several)."""
    return tuple(m for m in MODES if world >= 2 or not m.endswith("partition_activations"))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down, self.drop = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim), nn.Dropout(0.1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        h = h + self.drop(self.proj(a))
        return h + self.drop(self.down(F.gelu(self.up(self.ln2(h)))))


class Model(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(1024, args.dim)
        self.blocks = nn.ModuleList(Block(args.dim, 8) for _ in range(args.layers))
        self.head = nn.Linear(args.dim, 1024)
        self.checkpointed = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        import zeroshard.deepspeed.checkpointing as ckpt

        h = self.embed(idx)
        for block in self.blocks:
            h = ckpt.checkpoint(block, h) if self.checkpointed else block(h)
        return self.head(h)


class MPU:
    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def get_model_parallel_group(self) -> dist.ProcessGroup | None:
        return self.group

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self.group) if self.group is not None else 0

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self.group) if self.group is not None else 1


def _step(model: Model, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), x.flatten())


def saved_for_backward(model: nn.Module, forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Run ``forward()`` and return its result with the bytes held for backward once it is done: the
    tensors autograd saved (distinct storages, ``model``'s weights excluded) and the checkpointed
    inputs zeroshard keeps (``zeroshard.activations.STATS``)."""
    from zeroshard.activations import STATS

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    return out, sum(storages.values()) + STATS.live_bytes


def _saved(model: Model, x: torch.Tensor) -> tuple[int, int, int]:
    from zeroshard.activations import STATS

    loss, held = saved_for_backward(model, lambda: _step(model, x))
    inputs, host = STATS.live_bytes, STATS.host_bytes
    loss.backward()
    return held, inputs, host


def _cpu_peak(model: Model, x: torch.Tensor) -> int:
    return profiled_cpu_peak(lambda: _step(model, x).backward())


def profiled_cpu_peak(run: Callable[[], object]) -> int:
    """The peak of the bytes torch's CPU allocator held while ``run()`` ran (its profiler's memory
    events, replayed in time order), from what was live before it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    live = peak = 0
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _cuda_peak(model: Model, x: torch.Tensor) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _step(model, x).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def measure(rank: int, world: int, args: argparse.Namespace, store: str | None,
            modes: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    group = None
    if store is not None:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        group = dist.group.WORLD
    import zeroshard.deepspeed.checkpointing as ckpt

    dev = torch.device(args.device)
    model = Model(args).to(dev)
    x = torch.randint(0, 1024, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).to(dev)
    rows = []
    for mode in modes if modes is not None else modes_for(world):
        ckpt.configure(MPU(group), checkpoint_in_cpu=mode.endswith("cpu_checkpointing"),
                       partition_activations=mode.endswith("partition_activations"))
        model.checkpointed = mode != "plain"
        _step(model, x[:1, :8]).backward()  # warm-up: code paths loaded, gradients allocated
        gc.collect()
        proc_memory.reset_peak()
        base = proc_memory.status()["VmRSS"]
        times = []
        for _ in range(3):
            started = time.perf_counter()
            _step(model, x).backward()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        # the resident peak of the training steps, before the measuring passes below (the
        # profiler's own buffers would count in it)
        rss = proc_memory.status()["VmHWM"] - base if dev.type == "cpu" else -1
        saved, inputs, host = _saved(model, x)
        peak = _cuda_peak(model, x) if dev.type == "cuda" else _cpu_peak(model, x)
        rows.append({"mode": mode, "saved": saved, "inputs": inputs, "host": host, "peak": peak, "rss": rss,
                     "step": statistics.median(times)})
    if store is not None:
        dist.barrier()
        dist.destroy_process_group()
    return rows


def _entry(rank: int, world: int, args: argparse.Namespace, store: str, out: str, mode: str) -> None:
    torch.save(measure(rank, world, args, store, (mode,)), f"{out}.{rank}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    if args.device == "cuda":
        per_rank = [measure(0, 1, args, None)]
    else:
        per_rank = [[] for _ in range(args.world)]
        for mode in modes_for(args.world):
            with tempfile.TemporaryDirectory() as tmp:
                mp.start_processes(_entry, args=(args.world, args, f"{tmp}/store", f"{tmp}/out", mode),
                                   nprocs=args.world, start_method="spawn")
                for r in range(args.world):
                    per_rank[r] += torch.load(f"{tmp}/out.{r}", weights_only=True)
    peak = "CUDA peak (MiB)" if args.device == "cuda" else "CPU allocator peak (MiB)"
    lines = [f"Activation memory, {args.layers} blocks × dim {args.dim}, batch {args.batch} × {args.seq} tokens, "
             f"fp32, {args.device}, {len(per_rank)} rank(s); largest over ranks. Step times indicative only"
             f"{' (taken on a shared, loaded machine)' if args.device == 'cpu' else ''}. C allocator: "
             + allocator_text(allocator_settings()) + ".", "",
             f"| mode | saved for backward (MiB) | checkpointed inputs held (MiB) | of which in host memory (MiB) "
             f"| {peak} | peak RSS growth (MiB) | step (s) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for i, row in enumerate(per_rank[0]):
        worst = {k: max(r[i][k] for r in per_rank) for k in ("saved", "inputs", "host", "peak", "rss", "step")}
        rss = f"{worst['rss'] / MiB:.1f}" if worst["rss"] >= 0 else "–"
        lines.append(f"| {row['mode']} | {worst['saved'] / MiB:.1f} | {worst['inputs'] / MiB:.2f} | "
                     f"{worst['host'] / MiB:.2f} | {worst['peak'] / MiB:.1f} | {rss} | {worst['step']:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    name = "activation_memory-cuda.md" if args.device == "cuda" else "activation_memory.md"
    (Path(__file__).resolve().parents[1] / "results" / name).write_text(text)


if __name__ == "__main__":
    sys.exit(main())
