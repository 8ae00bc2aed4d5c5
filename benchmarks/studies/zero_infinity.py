"""ZeRO-Infinity on this machine: train a GPT whose fp32 training state is larger than its RAM.

    python benchmarks/studies/zero_infinity.py                              # 2.4B parameters (38 GB of fp32 state)
    python benchmarks/studies/zero_infinity.py --layers 2 --d-model 256     # a small check of the script (seconds)

The model is built under ``zeroshard.zero.Init(remote_device="nvme", config_dict_or_path=cfg)`` on
``--world-size`` CPU ranks (gloo), so no process ever holds it whole: each rank keeps its chunks,
and ``initialize`` moves them into the parameter swap file. ZeRO stage 3, fp32, AdamW, with
optimizer state, fp32 masters and parameters offloaded to NVMe (``--nvme-path``, created here),
stepped ``--sub-group`` elements at a time. The same fixed batch is trained ``--steps`` times, so
the loss falls within a few steps.

Reported: the parameter count and the fp32 training state (16 bytes per parameter) against this
machine's RAM; build and ``initialize`` times; then per step the loss, the step time (slowest rank,
between barriers), the bytes read and written (zeroshard's I/O engines, both ranks), the I/O bound
(those bytes ÷ the bandwidth ``disk_bandwidth.measure`` gives on ``--nvme-path`` in this run), the
peak RSS of each rank so far, and the bytes on disk. A Markdown report goes to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/studies/zero_infinity.py`: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from benchmarks.harness import proc_memory

GiB = float(1 << 30)
MiB = float(1 << 20)
REPO = Path(__file__).resolve().parents[2]


def gpt_numel(layers: int, d: int, vocab: int, seq: int) -> int:
    """Parameters of ``examples/gpt.py``'s GPT (biases on, untied embeddings)."""
    block = 12 * d * d + 13 * d  # qkv, proj, fc, proj weights and biases; two LayerNorms
    return layers * block + vocab * d * 2 + seq * d + 2 * d


def config(args: argparse.Namespace) -> dict[str, Any]:
    """Stage 3, fp32, optimizer and parameters on NVMe, small sub-groups and gather budgets."""
    nvme = str(args.nvme_path)
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000_000,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.0,
                                                  "torch_adam": True, "fused": True}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": args.sub_group,
            "stage3_max_live_parameters": args.max_live,
            "stage3_prefetch_bucket_size": args.prefetch,
            "reduce_bucket_size": args.prefetch,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": args.buffers},
            "offload_param": {"device": "nvme", "nvme_path": nvme, "buffer_count": args.buffers},
        },
    }


def _rss() -> tuple[int, int]:
    """(current, peak) resident bytes of this process."""
    st = proc_memory.status()
    return st["VmRSS"], st["VmHWM"]


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


def _io(engine: Any) -> tuple[int, int]:
    """Bytes zeroshard's NVMe I/O engines (optimizer store, parameter swap file) have moved."""
    engines = [engine.optimizer.store.io, engine.optimizer.shard.swap.io]
    return sum(e.bytes_read for e in engines), sum(e.bytes_written for e in engines)


def _gather(values: list[float]) -> list[list[float]]:
    """Every rank's ``values``."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def worker(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """One rank: build under zero.Init, initialize, train; rank 0's dict returns to the parent."""
    import torch.distributed as dist

    import zeroshard

    if str(REPO / "examples") not in sys.path:
        sys.path.insert(0, str(REPO / "examples"))
    from gpt import GPT, GPTConfig  # examples/gpt.py

    cfg = config(args)
    gcfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                     n_embd=args.d_model, dropout=0.0, bias=True)
    torch.manual_seed(1234)
    t = time.perf_counter()
    with zeroshard.zero.Init(remote_device="nvme", config_dict_or_path=cfg):
        model = GPT(gcfg)
    dist.barrier()
    build_s, rss_build = time.perf_counter() - t, _rss()
    t = time.perf_counter()
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    dist.barrier()
    init_s, rss_init = time.perf_counter() - t, _rss()
    g = torch.Generator().manual_seed(99)  # one fixed batch, the same on every rank and step
    batch = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g)
    x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    steps: list[dict[str, Any]] = []
    for _ in range(args.steps):
        io0 = _io(engine)
        dist.barrier()
        t = time.perf_counter()
        loss = engine(x, y)
        t_fwd = time.perf_counter()
        engine.backward(loss)
        t_bwd = time.perf_counter()
        engine.step()
        t_opt = time.perf_counter()
        dist.barrier()
        step_s = time.perf_counter() - t
        io1 = _io(engine)
        row = _gather([float(loss.detach()), io1[0] - io0[0], io1[1] - io0[1], *_rss()])
        # this rank's forward (parameter reads and all-gathers inside), backward (reads, gathers,
        # reduce-scatter) and optimizer step (the sub-group swap pipeline, publishing the parameters)
        phases = (t_fwd - t, t_bwd - t_fwd, t_opt - t_bwd)
        steps.append({"step_s": step_s, "phases": phases, "loss": [r[0] for r in row], "read": sum(r[1] for r in row),
                      "written": sum(r[2] for r in row), "rss": [r[3] for r in row], "peak_rss": [r[4] for r in row],
                      "disk_bytes": _disk_bytes(args.nvme_path)})
        if rank == 0:
            s = steps[-1]
            print(f"step {len(steps)}: loss {s['loss'][0]:.4f}, {s['step_s']:.1f} s, read {s['read'] / GiB:.1f} GiB, "
                  f"written {s['written'] / GiB:.1f} GiB, peak RSS {max(s['peak_rss']) / GiB:.2f} GiB", flush=True)
    numel = sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters())
    setup = _gather([build_s, init_s, *rss_build, *rss_init])
    placement = engine.optimizer.memory_placement()  # after a step: the optimizer state exists
    engine.destroy()  # removes the swap files
    return {"numel": numel, "setup": setup, "steps": steps, "placement": placement}


def report(args: argparse.Namespace, r: dict[str, Any], bw: list[tuple[float, float]], loads: list[float],
           ram: int, wall_s: float) -> str:
    """The Markdown report."""
    from benchmarks.harness.machine import describe

    git = describe()["zeroshard_git"]

    numel = r["numel"]
    rb, wb = (sum(b[i] for b in bw) / len(bw) for i in (0, 1))
    setup = r["setup"]
    lines = [
        "# ZeRO-Infinity on this machine: a model whose fp32 training state is larger than RAM", "",
        f"- Command: `{args.command}`",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M')}; torch {torch.__version__}; zeroshard git {git}; "
        f"{os.cpu_count()} CPU cores, "
        f"{ram / GiB:.1f} GiB RAM; load average (1 min) at start / end {loads[0]:.2f} / {loads[-1]:.2f}"
        + (" — **taken under contention** (other jobs shared the cores)" if max(loads) > 1.5 else ""),
        f"- Model: GPT (examples/gpt.py), {args.layers} layers, d_model {args.d_model}, {args.heads} heads, vocab "
        f"{args.vocab}, sequence {args.seq}: **{numel / 1e9:.3f}B parameters**; fp32 training state (16 B/parameter: "
        f"weights, gradients, Adam's two moments) **{16 * numel / GiB:.1f} GiB = {16 * numel / ram:.2f}× this "
        "machine's RAM**",
        f"- {args.world_size} CPU ranks (gloo), ZeRO stage 3, fp32, AdamW lr {args.lr}, clipping 1.0, micro batch "
        f"{args.micro_batch}, the same batch every step; built under `zero.Init(remote_device=\"nvme\")`; optimizer "
        f"state, fp32 masters and parameters offloaded to NVMe under `{args.nvme_path}`; `sub_group_size` "
        f"{args.sub_group:.0e}, `stage3_max_live_parameters` {args.max_live:.0e}, `stage3_prefetch_bucket_size` "
        f"{args.prefetch:.0e}, buffer_count {args.buffers} (optimizer sub-groups and parameter units)",
        f"- Disk bandwidth on `{args.nvme_path}` (`disk_bandwidth.measure`, 1 thread, 1 MiB blocks, O_DIRECT), "
        f"before / after: read {bw[0][0]:.2f} / {bw[-1][0]:.2f} GiB/s, write {bw[0][1]:.2f} / {bw[-1][1]:.2f} GiB/s; "
        f"the I/O bound is both ranks' bytes read ÷ {rb:.2f} GiB/s + bytes written ÷ {wb:.2f} GiB/s",
        f"- Build under `zero.Init`: {max(s[0] for s in setup):.1f} s, RSS per rank after it "
        + ", ".join(f"{s[2] / GiB:.2f}" for s in setup) + " GiB; `initialize`: "
        f"{max(s[1] for s in setup):.1f} s, peak RSS per rank by its end "
        + ", ".join(f"{s[5] / GiB:.2f}" for s in setup) + f" GiB; whole run {wall_s / 60:.1f} min",
        "- Rank 0's `memory_placement()` (GiB): " + "; ".join(
            f"{k}: " + ", ".join(f"{p} {b / GiB:.2f}" for p, b in v.items()) for k, v in r["placement"].items() if v),
        "", "| step | loss (rank 0) | step (s) | fwd / bwd / opt (s, rank 0) | read GiB | written GiB "
        "| I/O bound (s) | step ÷ bound | peak RSS GiB per rank | on disk GiB |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---|---:|",
    ]
    for i, s in enumerate(r["steps"], 1):
        bound = s["read"] / (rb * GiB) + s["written"] / (wb * GiB)
        ph = " / ".join(f"{x:.1f}" for x in s["phases"])
        lines.append(f"| {i} | {s['loss'][0]:.4f} | {s['step_s']:.1f} | {ph} | {s['read'] / GiB:.1f} | "
                     f"{s['written'] / GiB:.1f} | {bound:.1f} | {s['step_s'] / bound:.2f} | "
                     + ", ".join(f"{p / GiB:.2f}" for p in s["peak_rss"]) + f" | {s['disk_bytes'] / GiB:.1f} |")
    losses = [s["loss"][0] for s in r["steps"]]
    falls = all(b < a for a, b in zip(losses, losses[1:]))
    lines += ["", f"Loss {'falls at every step' if falls else '**does not fall at every step**'}: "
              + " → ".join(f"{v:.4f}" for v in losses) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Check the disk, measure it, train, report."""
    from benchmarks.harness.spawned import run_on_ranks
    from benchmarks.studies.disk_bandwidth import measure
    from benchmarks.studies.offload import kept_notes

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--d-model", type=int, default=2560)
    p.add_argument("--heads", type=int, default=20)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--sub-group", type=float, default=5e7, help="sub_group_size (elements per optimizer sub-group)")
    p.add_argument("--max-live", type=float, default=1e8, help="stage3_max_live_parameters")
    p.add_argument("--prefetch", type=float, default=5e7, help="stage3_prefetch_bucket_size")
    p.add_argument("--buffers", type=int, default=3, help="buffer_count of offload_optimizer and offload_param")
    p.add_argument("--nvme-path", type=Path, default=Path("/tmp/zeroshard-nvme"))
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "zero_infinity.md")
    args = p.parse_args(argv)
    args.command = " ".join(["python benchmarks/studies/zero_infinity.py", *(sys.argv[1:] if argv is None else argv)])
    args.nvme_path.mkdir(parents=True, exist_ok=True)
    numel = gpt_numel(args.layers, args.d_model, args.vocab, args.seq)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    need, free = 20 * numel, shutil.disk_usage(args.nvme_path).free  # 16 B optimizer + 4 B parameter shard
    print(f"{numel / 1e9:.3f}B parameters, fp32 training state {16 * numel / GiB:.1f} GiB "
          f"({16 * numel / ram:.2f}x RAM); swap files need about {need / GiB:.1f} GiB, {free / GiB:.1f} GiB free",
          flush=True)
    if need * 1.05 > free:
        print(f"not enough free disk under {args.nvme_path}: about {need / GiB:.1f} GiB needed", file=sys.stderr)
        return 1
    loads = [os.getloadavg()[0]]
    bw = [measure(args.nvme_path, 1 << 30, 1, 1 << 20)]
    t = time.monotonic()
    result = run_on_ranks(worker, args.world_size, args)
    wall_s = time.monotonic() - t
    bw.append(measure(args.nvme_path, 1 << 30, 1, 1 << 20))
    loads.append(os.getloadavg()[0])
    text = report(args, result, bw, loads, ram, wall_s) + kept_notes(args.out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
