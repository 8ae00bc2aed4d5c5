"""ZeRO-Infinity on this machine: train a GPT whose fp32 training state is larger than its RAM.

    python benchmarks/studies/zero_infinity.py                              # 2.4B parameters (38 GB of fp32 state)
    python benchmarks/studies/zero_infinity.py --layers 2 --d-model 256     # a small check of the script (seconds)
    python benchmarks/studies/zero_infinity.py --sizes 0.6b,1.5b,3.5b       # several sizes in sequence, one report

``--sizes`` names GPT shapes at d_model 2560 (:data:`SIZES`: 6, 18, 28, 40 and 43 layers; an integer is
a layer count) and runs each in turn on a fresh set of ranks, its own disk measurement and swap files,
so that one report shows how host memory and the bytes on disk move with the model's size.

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

Memory is followed three ways: each rank's ``VmHWM`` (reset after the build and after ``initialize``,
so each phase has its own peak), a thread in each rank sampling ``/proc/self/status`` every 0.1 s
(anonymous against file-backed and shared resident memory at the highest sample: the gradient spill
and the ``zero.Init`` chunks are file-backed), and a thread in this process sampling the system's
``/proc/meminfo`` (``Dirty``, ``Writeback``, ``Cached``: the spilled pages live in the page cache). Block
I/O of each rank (``/proc/self/io`` ``read_bytes``/``write_bytes``) is reported beside the engines' bytes:
the difference is the page cache's traffic (spill pages written back or read again, dirtied pages
counted when dirtied).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import threading
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

#: ``--sizes`` names: layers of a GPT at d_model 2560, 20 heads, vocab 32000, sequence 128
#: (``gpt_numel``: 0.636B, 1.580B, 2.367B, 3.311B, 3.547B parameters; 16 B of fp32 state each)
SIZES = {"0.6b": 6, "1.5b": 18, "2.4b": 28, "3.3b": 40, "3.5b": 43}


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


class _Sampler(threading.Thread):
    """Reads ``path`` (``/proc/self/status`` or ``/proc/meminfo``) every ``every`` seconds and keeps,
    since the last :meth:`take`, the sample with the largest ``key`` and each field's maximum."""

    def __init__(self, path: str, fields: tuple[str, ...], key: str, every: float) -> None:
        super().__init__(daemon=True)
        self.path, self.fields, self.key, self.every = path, fields, key, every
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._top: dict[str, int] = {}
        self._max: dict[str, int] = {}
        #: what the process is doing now (an index into ``PHASES``), kept with the highest sample
        self.phase = 0
        self.first = self.read()

    def read(self) -> dict[str, int]:
        out = {}
        with open(self.path) as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in self.fields:
                    out[k] = int(v.split()[0]) * 1024
        return out

    def run(self) -> None:
        while not self._halt.wait(self.every):
            self.note()

    def note(self) -> None:
        r = self.read()
        r["phase"] = self.phase
        with self._lock:
            if r.get(self.key, 0) >= self._top.get(self.key, -1):
                self._top = r
            for k, v in r.items():
                self._max[k] = max(v, self._max.get(k, v))

    def take(self) -> tuple[dict[str, int], dict[str, int]]:
        """(the sample with the largest ``key``, each field's maximum) since the last call."""
        self.note()
        with self._lock:
            out = (self._top, self._max)
            self._top, self._max = {}, {}
        return out

    def stop(self) -> None:
        self._halt.set()
        self.join()


_STATUS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "phase")
PHASES = ("build", "initialize", "forward", "backward", "step", "between")
_MEMINFO = ("Dirty", "Writeback", "Cached", "MemAvailable")


def _block_io() -> tuple[int, int]:
    """(read_bytes, write_bytes) of ``/proc/self/io``: what this process had the block layer move."""
    v = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, _, n = line.partition(":")
            v[k] = int(n)
    return v["read_bytes"], v["write_bytes"]


def _writeback() -> int:
    """Bytes the whole system has written back from the page cache (``/proc/vmstat`` ``nr_written``):
    the spilled gradient pages on their way to disk, with other jobs' writes."""
    with open("/proc/vmstat") as f:
        for line in f:
            k, _, n = line.partition(" ")
            if k == "nr_written":
                return int(n) * os.sysconf("SC_PAGE_SIZE")
    return 0


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

    sampler = _Sampler("/proc/self/status", _STATUS, "VmRSS", 0.1)
    sampler.start()
    cfg = config(args)
    gcfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                     n_embd=args.d_model, dropout=0.0, bias=True)
    torch.manual_seed(1234)
    t = time.perf_counter()
    with zeroshard.zero.Init(remote_device="nvme", config_dict_or_path=cfg):
        model = GPT(gcfg)
    dist.barrier()
    build_s, rss_build, top_build = time.perf_counter() - t, _rss(), sampler.take()[0]
    proc_memory.reset_peak()  # VmHWM := VmRSS: initialize's own peak next
    t = time.perf_counter()
    sampler.phase = 1
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    dist.barrier()
    init_s, rss_init, top_init = time.perf_counter() - t, _rss(), sampler.take()[0]
    if args.checkpoint:  # one activation checkpoint per block: only its input is kept for backward
        for block in engine.module.blocks:
            block.forward = functools.partial(zeroshard.checkpointing.checkpoint, block.forward)
    proc_memory.reset_peak()  # and training's
    g = torch.Generator().manual_seed(99)  # one fixed batch, the same on every rank and step
    batch = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g)
    x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    steps: list[dict[str, Any]] = []
    for _ in range(args.steps):
        io0, blk0, wb0 = _io(engine), _block_io(), _writeback()
        dist.barrier()
        t = time.perf_counter()
        sampler.phase = 2
        loss = engine(x, y)
        t_fwd = time.perf_counter()
        sampler.phase = 3
        engine.backward(loss)
        t_bwd = time.perf_counter()
        sampler.phase = 4
        engine.step()
        t_opt = time.perf_counter()
        sampler.phase = 5
        dist.barrier()
        step_s = time.perf_counter() - t
        io1, blk1, wb1 = _io(engine), _block_io(), _writeback()
        top = sampler.take()[0]
        row = _gather([float(loss.detach()), io1[0] - io0[0], io1[1] - io0[1], *_rss(),
                       blk1[0] - blk0[0], blk1[1] - blk0[1], *(top.get(k, 0) for k in _STATUS)])
        # this rank's forward (parameter reads and all-gathers inside), backward (reads, gathers,
        # reduce-scatter) and optimizer step (the sub-group swap pipeline, publishing the parameters)
        phases = (t_fwd - t, t_bwd - t_fwd, t_opt - t_bwd)
        steps.append({"step_s": step_s, "phases": phases, "loss": [r[0] for r in row], "read": sum(r[1] for r in row),
                      "written": sum(r[2] for r in row), "rss": [r[3] for r in row], "peak_rss": [r[4] for r in row],
                      "blk_read": sum(r[5] for r in row), "blk_written": sum(r[6] for r in row),
                      "top": [dict(zip(_STATUS, r[7:])) for r in row], "writeback": wb1 - wb0,
                      "disk_bytes": _disk_bytes(args.nvme_path)})
        if rank == 0:
            s = steps[-1]
            print(f"step {len(steps)}: loss {s['loss'][0]:.4f}, {s['step_s']:.1f} s, read {s['read'] / GiB:.1f} GiB, "
                  f"written {s['written'] / GiB:.1f} GiB, peak RSS {max(s['peak_rss']) / GiB:.2f} GiB", flush=True)
    sampler.stop()
    numel = sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters())
    setup = _gather([build_s, init_s, *rss_build, *rss_init, *(top_build.get(k, 0) for k in _STATUS[:4]),
                     *(top_init.get(k, 0) for k in _STATUS[:4])])
    placement = engine.optimizer.memory_placement()  # after a step: the optimizer state exists
    breakdown = engine.optimizer.memory_breakdown()  # comm_workspace: the reduce buckets' pool
    engine.destroy()  # removes the swap files
    return {"numel": numel, "setup": setup, "steps": steps, "placement": placement, "breakdown": breakdown}


class _SystemSampler(_Sampler):
    """The system's page cache (``/proc/meminfo``) and the bytes used on the ``nvme_path``'s filesystem
    (swap files and whatever of the unlinked spill buffers was written back), every ``every`` seconds."""

    def __init__(self, root: Path, every: float) -> None:
        self.root = root
        super().__init__("/proc/meminfo", _MEMINFO, "Dirty", every)

    def read(self) -> dict[str, int]:
        out = super().read()
        out["DiskUsed"] = shutil.disk_usage(self.root).used
        out["MemAvailableNeg"] = -out.get("MemAvailable", 0)  # its maximum is the least available
        return out


def _g(b: float) -> str:
    return f"{b / GiB:.2f}"


def _size_name(layers: int) -> str:
    return next((k for k, v in SIZES.items() if v == layers), f"{layers} layers")


def _bound(s: dict[str, Any], bw: tuple[float, float]) -> float:
    return s["read"] / (bw[0] * GiB) + s["written"] / (bw[1] * GiB)


def summary(runs: list[dict[str, Any]], ram: int) -> list[str]:
    """One row per size: what stays flat (host memory) against what grows (state, disk)."""
    lines = [
        "| size | parameters | fp32 state GiB (× RAM) | build (s) | RSS after build, GiB per rank | `initialize` "
        "peak RSS, GiB per rank | training peak RSS, GiB per rank | at rank 0's training peak: anon / file / shmem "
        "GiB (when) | loss per step (rank 0) | last step (s) | read / written GiB per step | I/O bound (s) "
        "| step ÷ bound | swap files GiB | disk used, peak growth GiB | page cache: Dirty / Cached, peak growth GiB |",
        "|---|---:|---|---:|---|---|---|---|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for run in runs:
        name = _size_name(run["layers"])
        if "skipped" in run:
            lines.append(f"| {name} | {run['numel'] / 1e9:.3f}B | {16 * run['numel'] / GiB:.1f} "
                         f"({16 * run['numel'] / ram:.2f}×) | not run: {run['skipped']} |" + " |" * 12)
            continue
        r, sy = run["result"], run["system"]
        numel, setup, steps = r["numel"], r["setup"], r["steps"]
        last, bw = steps[-1], run["bw_mean"]
        top = max(steps, key=lambda st: st["top"][0]["VmRSS"])["top"][0]
        lines.append(
            f"| {name} | {numel / 1e9:.3f}B | {16 * numel / GiB:.1f} ({16 * numel / ram:.2f}×) | "
            f"{max(x[0] for x in setup):.1f} | " + ", ".join(_g(x[2]) for x in setup) + " | "
            + ", ".join(_g(x[5]) for x in setup) + " | "
            + ", ".join(_g(max(st["peak_rss"][i] for st in steps)) for i in range(len(setup))) + " | "
            + " / ".join(_g(top[k]) for k in ("RssAnon", "RssFile", "RssShmem"))
            + f" ({PHASES[int(top['phase'])]}) | "
            + " → ".join(f"{st['loss'][0]:.3f}" for st in steps) + f" | {last['step_s']:.1f} | "
            f"{last['read'] / GiB:.1f} / {last['written'] / GiB:.1f} | {_bound(last, bw):.1f} | "
            f"{last['step_s'] / _bound(last, bw):.2f} | {max(st['disk_bytes'] for st in steps) / GiB:.1f} | "
            f"{(sy['max']['DiskUsed'] - sy['first']['DiskUsed']) / GiB:.1f} | "
            f"{_g(sy['max']['Dirty'] - sy['first']['Dirty'])} / {_g(sy['max']['Cached'] - sy['first']['Cached'])} |")
    return lines


def details(args: argparse.Namespace, run: dict[str, Any], ram: int) -> list[str]:
    """One size: its setup, memory placement and per-step table."""
    r, bw, sy = run["result"], run["bw"], run["system"]
    numel, setup = r["numel"], r["setup"]
    rb, wb = run["bw_mean"]

    def comp(x: list[float]) -> str:
        return " / ".join(_g(v) for v in x[1:4])  # anon / file / shmem of one sample (VmRSS first)

    lines = [
        "", f"## {_size_name(run['layers']).replace(' layers', '')} layers, {numel / 1e9:.3f}B parameters"
        if _size_name(run["layers"]).endswith(" layers") else
        f"## {_size_name(run['layers'])}: {run['layers']} layers, {numel / 1e9:.3f}B parameters", "",
        f"- fp32 training state {16 * numel / GiB:.1f} GiB = {16 * numel / ram:.2f}× RAM; run {run['wall_s'] / 60:.1f} "
        f"min; load average (1 min) at start / end {run['loads'][0]:.2f} / {run['loads'][1]:.2f}; free disk under "
        f"`{args.nvme_path}` before it {run['free'] / GiB:.1f} GiB",
        f"- Disk bandwidth (`disk_bandwidth.measure`, 1 thread, 1 MiB blocks, O_DIRECT), before / after: read "
        f"{bw[0][0]:.2f} / {bw[1][0]:.2f} GiB/s, write {bw[0][1]:.2f} / {bw[1][1]:.2f} GiB/s; I/O bound = both ranks' "
        f"bytes read ÷ {rb:.2f} GiB/s + bytes written ÷ {wb:.2f} GiB/s",
        f"- Build under `zero.Init`: {max(x[0] for x in setup):.1f} s; RSS per rank after it "
        + ", ".join(_g(x[2]) for x in setup) + ", its peak " + ", ".join(_g(x[3]) for x in setup)
        + " GiB (rank 0 at its highest sample, anon / file / shmem: " + comp(setup[0][6:10]) + "); `initialize`: "
        f"{max(x[1] for x in setup):.1f} s, RSS after it " + ", ".join(_g(x[4]) for x in setup) + ", its peak "
        + ", ".join(_g(x[5]) for x in setup) + " GiB (rank 0: " + comp(setup[0][10:14]) + ")",
        "- Rank 0's `memory_placement()` (GiB): " + "; ".join(
            f"{k}: " + ", ".join(f"{p} {_g(b)}" for p, b in v.items()) for k, v in r["placement"].items() if v)
        + "; `memory_breakdown()` in memory: " + ", ".join(f"{k} {_g(v)}" for k, v in r["breakdown"].items()),
        "- System over the run (`/proc/meminfo`, every 0.5 s; other jobs included), from the start to the highest "
        f"sample: Dirty {_g(sy['first']['Dirty'])} → {_g(sy['max']['Dirty'])}, Writeback up to "
        f"{_g(sy['max']['Writeback'])}, Cached {_g(sy['first']['Cached'])} → {_g(sy['max']['Cached'])}, MemAvailable "
        f"{_g(sy['first']['MemAvailable'])} → least {_g(-sy['max']['MemAvailableNeg'])} GiB; disk used on the "
        f"filesystem up to {_g(sy['max']['DiskUsed'] - sy['first']['DiskUsed'])} GiB above the start",
        "", "| step | loss (rank 0) | step (s) | fwd / bwd / opt (s, rank 0) | read GiB | written GiB | I/O bound (s) "
        "| step ÷ bound | block I/O read / written GiB | written back GiB | peak RSS GiB per rank "
        "| rank 0 at its highest sample: anon / file / shmem GiB (when) | swap files GiB |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---|---:|---|---|---:|",
    ]
    for i, s in enumerate(r["steps"], 1):
        bound = _bound(s, (rb, wb))
        ph = " / ".join(f"{x:.1f}" for x in s["phases"])
        t0 = s["top"][0]
        lines.append(f"| {i} | {s['loss'][0]:.4f} | {s['step_s']:.1f} | {ph} | {s['read'] / GiB:.1f} | "
                     f"{s['written'] / GiB:.1f} | {bound:.1f} | {s['step_s'] / bound:.2f} | "
                     f"{s['blk_read'] / GiB:.1f} / {s['blk_written'] / GiB:.1f} | {s['writeback'] / GiB:.1f} | "
                     + ", ".join(_g(p) for p in s["peak_rss"]) + " | "
                     + " / ".join(_g(t0[k]) for k in ("RssAnon", "RssFile", "RssShmem"))
                     + f" ({PHASES[int(t0['phase'])]}) | {s['disk_bytes'] / GiB:.1f} |")
    losses = [s["loss"][0] for s in r["steps"]]
    falls = all(b < a for a, b in zip(losses, losses[1:]))
    lines += ["", f"Loss {'falls at every step' if falls else '**does not fall at every step**'}: "
              + " → ".join(f"{v:.4f}" for v in losses) + "."]
    return lines


def report(args: argparse.Namespace, runs: list[dict[str, Any]], ram: int, wall_s: float) -> str:
    """The Markdown report."""
    from benchmarks.harness.machine import describe

    git = describe()["zeroshard_git"]
    loads = [x for run in runs for x in run.get("loads", [])] or [os.getloadavg()[0]]
    lines = [
        "# ZeRO-Infinity on this machine: models whose fp32 training state outgrows RAM", "",
        f"- Command: `{args.command}`",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M')}; torch {torch.__version__}; zeroshard git {git}; "
        f"{os.cpu_count()} CPU cores, {ram / GiB:.1f} GiB RAM; load average (1 min) from {min(loads):.2f} to "
        f"{max(loads):.2f}"
        + (" — **taken under contention** (other jobs shared the cores)" if max(loads) > 1.5 else "")
        + f"; whole run {wall_s / 60:.1f} min",
        f"- Free disk under `{args.nvme_path}` before the first size: {runs[0]['free'] / GiB:.1f} GiB",
        f"- Model: GPT (examples/gpt.py), d_model {args.d_model}, {args.heads} heads, vocab {args.vocab}, sequence "
        f"{args.seq}; fp32 training state = 16 B/parameter (weights, gradients, Adam's two moments)",
        f"- {args.world_size} CPU ranks (gloo), ZeRO stage 3, fp32, AdamW lr {args.lr}, clipping 1.0, micro batch "
        f"{args.micro_batch}, the same batch every step, {args.steps} steps"
        + ("; one activation checkpoint per block (`zeroshard.checkpointing.checkpoint`)" if args.checkpoint else
           "; no activation checkpointing") + "; built under "
        "`zero.Init(remote_device=\"nvme\", config_dict_or_path=cfg)`; optimizer state, fp32 masters and parameters "
        f"offloaded to NVMe under `{args.nvme_path}`; `sub_group_size` {args.sub_group:.0e}, "
        f"`stage3_max_live_parameters` {args.max_live:.0e}, `stage3_prefetch_bucket_size` and `reduce_bucket_size` "
        f"{args.prefetch:.0e}, buffer_count {args.buffers} (optimizer sub-groups and parameter units)",
        "- Peak RSS: `VmHWM`, reset after the build and after `initialize`, so each phase's peak is its own; anon / "
        "file / shmem: `RssAnon`, `RssFile`, `RssShmem` of the highest of the 0.1 s samples of `/proc/self/status`; "
        "block I/O: both ranks' `/proc/self/io` (dirtied page-cache pages are counted when dirtied); written back: the "
        "system's page-cache writeback in the step (`/proc/vmstat` `nr_written`, other jobs included); swap files: "
        "the files under the nvme path (the spill buffers are unlinked and not among them: disk used counts what "
        "of them was written back)",
        "", *summary(runs, ram),
    ]
    for run in runs:
        if "skipped" not in run:
            lines += details(args, run, ram)
    return "\n".join(lines) + "\n"


def run_size(args: argparse.Namespace, layers: int, ram: int) -> dict[str, Any]:
    """One size on fresh ranks, between two disk measurements, with the system sampled meanwhile."""
    from benchmarks.harness.spawned import run_on_ranks
    from benchmarks.studies.disk_bandwidth import measure

    args.layers = layers
    numel = gpt_numel(layers, args.d_model, args.vocab, args.seq)
    # 16 B optimizer (masters, two moments) + 4 B parameter shard; the gradient spill (4 B) is
    # sparse and written back only under memory pressure, within the 5% margin's reach at worst
    need, free = 20 * numel, shutil.disk_usage(args.nvme_path).free
    print(f"{_size_name(layers)}: {numel / 1e9:.3f}B parameters, fp32 training state {16 * numel / GiB:.1f} GiB "
          f"({16 * numel / ram:.2f}x RAM); swap files need about {need / GiB:.1f} GiB, {free / GiB:.1f} GiB free",
          flush=True)
    run: dict[str, Any] = {"layers": layers, "numel": numel, "free": free}
    if need * 1.05 > free:
        run["skipped"] = f"{need / GiB:.1f} GiB of disk needed, {free / GiB:.1f} free"
        print(f"not enough free disk under {args.nvme_path}: {run['skipped']}", file=sys.stderr)
        return run
    loads = [os.getloadavg()[0]]
    bw = [measure(args.nvme_path, 1 << 30, 1, 1 << 20)]
    system = _SystemSampler(args.nvme_path, 0.5)
    system.start()
    t = time.monotonic()
    run["result"] = run_on_ranks(worker, args.world_size, args)
    run["wall_s"] = time.monotonic() - t
    top, peak = system.take()
    system.stop()
    run["system"] = {"first": system.first, "max": peak}
    bw.append(measure(args.nvme_path, 1 << 30, 1, 1 << 20))
    loads.append(os.getloadavg()[0])
    run.update(bw=bw, bw_mean=tuple(sum(b[i] for b in bw) / len(bw) for i in (0, 1)), loads=loads)
    return run


def main(argv: list[str] | None = None) -> int:
    """Check the disk, measure it, train each size, report."""
    from benchmarks.harness.report import kept_notes
    from benchmarks.studies.offload import NOTES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--sizes", default="", help=f"comma-separated sizes run in turn ({', '.join(SIZES)}, or a layer "
                   "count); overrides --layers")
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
    p.add_argument("--checkpoint", action="store_true",
                   help="activation checkpoint per block (zeroshard.checkpointing.checkpoint): backward keeps only "
                   "each block's input, not the ~20 MiB of activations per layer that grow the peak with depth")
    p.add_argument("--nvme-path", type=Path, default=Path("/tmp/zeroshard-nvme"))
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "zero_infinity.md")
    args = p.parse_args(argv)
    args.command = " ".join(["python benchmarks/studies/zero_infinity.py", *(sys.argv[1:] if argv is None else argv)])
    layers = [SIZES[x] if x in SIZES else int(x) for x in args.sizes.split(",") if x] or [args.layers]
    args.nvme_path.mkdir(parents=True, exist_ok=True)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    t = time.monotonic()
    runs = [run_size(args, n, ram) for n in layers]
    if all("skipped" in run for run in runs):
        return 1
    text = report(args, runs, ram, time.monotonic() - t) + kept_notes(args.out, NOTES)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
