#!/usr/bin/env python3
"""ZeRO++ on the emulated two-node cluster: loss parity, bytes across the link and step time of qwZ
(``zero_quantized_weights``), qgZ (``zero_quantized_gradients``), hpZ (``zero_hpz_partition_size``)
and hybrid sharding (``hybrid_shard_size``) against plain ZeRO-3; then DeepSpeed 0.19.8's ZeRO++ on CPU.

    python benchmarks/studies/zeropp.py             # as root; about 35 minutes on a shared 2-core machine
    python benchmarks/studies/zeropp.py --parity-steps 20 --timed-rounds 2 --extra-rate '' --out /tmp/zeropp.md

Every run is the benchmark's GPT 25M (``benchmarks/harness/spec.py`` ``25m``; ``--model``) in bf16 at
ZeRO stage 3 with the comparison's DeepSpeed-schema config (``harness/systems/base.py``), micro batch
``--micro-batch`` × ``--seq-len`` (1 × 64 by default, to fit the time), on 4 gloo ranks as 2 nodes × 2:
``tests/emulated_cluster.py`` puts each node in a network namespace, joins them by a veth pair and
starts ``torchrun --nnodes 2 --nproc-per-node 2`` in each, so ranks of one node talk over its
loopback and ranks of different nodes over the veth, and zeroshard's topology (``LOCAL_WORLD_SIZE=2``)
has two levels. The variants of a job are built in the same four processes, each on its own model from
the same seed, and train side by side, one step each in turn (who goes first rotates), on the same
batches: the pairing of ``harness/paired.py``. ``/R`` variants release units after forward
(:data:`RELEASED`), so that backward gathers again, the gather hpZ keeps inside a node; they are
compared with ``plain/R``.

Jobs (this file with ``--worker``), link unthrottled unless said:

1. *parity*: ``--parity-steps`` steps of plain, qwZ, qgZ and qwZ+qgZ: every step's loss (mean over
   the 4 ranks), the final loss (mean of the last 10) and its relative difference from plain.
2. *bytes*: a few steps of every variant with the communication logger on (``comms_logger``,
   ``prof_all``): rank 0's ``bytes_by_level`` and bytes per collective, and what each kind of
   collective put on the link: around every logged collective the study adds a world barrier and
   rank 0 reads its veth's ``tx_bytes`` + ``rx_bytes`` (both directions) before it and after the
   barrier, less what a barrier alone costs (measured first).
3. *deepspeed*: DeepSpeed at stage 3, plain and with each ZeRO++ key, in the same harness:
   ``deepspeed.initialize`` then ``--ds-steps`` steps, or the exact error and where it was raised.
4. *timed* (link throttled with tbf to ``--rate``, 1gbit, at both ends): ``--timed-warmup`` +
   ``--timed-rounds`` rounds of every variant without the logger: median step time (between world
   barriers: the slowest rank), its median ratio to plain round by round, and the bytes each step
   put on the link (veth counters), which the issue's byte goals are read from.
5. *extra* (``--extra-rate``, 200mbit; '' skips it): the same for a few variants, where the link
   rather than the CPU sets the pace.

Writes ``--out`` (``benchmarks/results/zeropp.md``) and the loss curves next to it
(``zeropp_loss.png``, matplotlib), keeping a hand-written ``## Notes`` section of the file it
overwrites; worker logs and the raw JSON go to ``benchmarks/out/zeropp/``. Needs root and iproute2
(``tests/emulated_cluster.available()`` says why not).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run by path (and by torchrun): make the repository root importable
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
LOGS = ROOT / "benchmarks" / "out" / "zeropp"
PLAIN = "plain"
RELEASED = {"stage3_max_live_parameters": 3_200_000, "stage3_prefetch_bucket_size": 3_200_000}
"""The live budget of ``results/stage3_knobs.md``'s FSDP2-like row (about one block gathered): units
are released after forward and gathered again in backward, the gather hpZ keeps inside a node."""
_QWZ = {"zero_quantized_weights": True}
_QGZ = {"zero_quantized_gradients": True}
_HPZ = {"zero_hpz_partition_size": 2}
VARIANTS: dict[str, dict[str, Any]] = {
    PLAIN: {},
    "qwZ": _QWZ,
    "qgZ": _QGZ,
    "qwZ+qgZ": {**_QWZ, **_QGZ},
    "qwZ+qgZ+hpZ": {**_QWZ, **_QGZ, **_HPZ},
    "hybrid": {"hybrid_shard_size": 2},
    "plain/R": RELEASED,
    "hpZ/R": {**_HPZ, **RELEASED},
    "qwZ+qgZ/R": {**_QWZ, **_QGZ, **RELEASED},
    "qwZ+qgZ+hpZ/R": {**_QWZ, **_QGZ, **_HPZ, **RELEASED},
    "bf16-reduce": {"communication_data_type": "bf16"},
    "bf16-reduce/R": {"communication_data_type": "bf16", **RELEASED},
}
"""zero_optimization keys of each variant (merged into the shared config; :data:`TOP_LEVEL` keys go to
the config's top level); ``/R``: with :data:`RELEASED`, compared with ``plain/R``. ``bf16-reduce``:
plain ZeRO-3 reducing gradients in bf16, as DeepSpeed does by default in bf16 training (zeroshard
reduces in fp32); not in the default run (``--variants``)."""
TOP_LEVEL = ("communication_data_type",)
DEFAULT = tuple(n for n in VARIANTS if not n.startswith("bf16-reduce"))
PARITY = (PLAIN, "qwZ", "qgZ", "qwZ+qgZ")
EXTRA = (PLAIN, "qwZ+qgZ", "hybrid", "plain/R", "qwZ+qgZ+hpZ/R")
SAME = (("qwZ+qgZ+hpZ", "qwZ+qgZ"), ("hpZ/R", "plain/R"), ("qwZ+qgZ+hpZ/R", "qwZ+qgZ/R"))
"""Pairs that must train identically (hpZ's secondary shards are copies of gathered values)."""
DS_VARIANTS = {PLAIN: {}, "qwZ": _QWZ, "qgZ": _QGZ, "hpZ": _HPZ, "hpZ/R": VARIANTS["hpZ/R"]}


def reference(name: str) -> str:
    """The plain ZeRO-3 run ``name`` is compared with (the same live budget)."""
    return "plain/R" if name.endswith("/R") else PLAIN


LAST = 10  # the final loss: mean of this many last steps
GRADIENT_OPS = ("reduce_scatter_tensor", "all_to_all_single", "all_reduce")  # all_reduce: hybrid's, and the norm
GATHER_OPS = ("all_gather_into_tensor",)


# -- worker side (one rank, under torchrun, inside a node's namespace) ------------------------------


class Link:
    """The veth of this rank's node: bytes sent plus bytes received (both directions of the link)."""

    def __init__(self, iface: str) -> None:
        stats = Path("/sys/class/net") / iface / "statistics"
        self.files = (stats / "tx_bytes", stats / "rx_bytes")

    def read(self) -> tuple[int, int]:
        tx, rx = (int(f.read_text()) for f in self.files)
        return tx, rx


class LinkAttribution:
    """Wraps the installed communication logger: after every collective a world barrier, so that the
    collective's bytes have crossed, and on rank 0 the link's counters before and after; the bytes
    are filed under the logger's name of the collective (``"<op> | <level>"``)."""

    def __init__(self, inner: Any, link: Link | None) -> None:
        self.inner, self.link = inner, link
        self.link_bytes: dict[str, int] = {}
        self.logged: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def run(self, op: str, nbytes: int, device: Any, launch: Any, level: str = "world") -> Any:
        import torch.distributed as dist

        before = self.link.read() if self.link else (0, 0)
        work = self.inner.run(op, nbytes, device, launch, level)  # the logger waits for it
        dist.barrier()
        after = self.link.read() if self.link else (0, 0)
        key = op if level == "world" else f"{op} | {level}"
        self.link_bytes[key] = self.link_bytes.get(key, 0) + sum(after) - sum(before)
        self.logged[key] = self.logged.get(key, 0) + nbytes
        self.calls[key] = self.calls.get(key, 0) + 1
        return work

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {"link": dict(self.link_bytes), "logged": dict(self.logged), "calls": dict(self.calls),
                "levels": dict(self.inner.bytes_by_level)}


def _delta(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]],
           into: dict[str, dict[str, int]]) -> None:
    for kind, values in after.items():
        acc = into.setdefault(kind, {})
        for key, v in values.items():
            acc[key] = acc.get(key, 0) + v - before.get(kind, {}).get(key, 0)


def _barrier_bytes(link: Link | None, n: int = 50) -> float:
    """What one world barrier puts on the link (rank 0's reading; 0 elsewhere)."""
    import torch.distributed as dist

    dist.barrier()
    before = link.read() if link else (0, 0)
    for _ in range(n):
        dist.barrier()
    after = link.read() if link else (0, 0)
    return (sum(after) - sum(before)) / n


def _job(args: argparse.Namespace, world: int, system: str) -> Any:
    from benchmarks.harness.spec import Job, Workload

    return Job(system, 3, args.model, world_size=world, dtype=args.dtype,
               workload=Workload(micro_batch=args.micro_batch, seq_len=args.seq_len))


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:900]


def train_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Build every variant in this process, train them side by side, return rank 0's record."""
    import torch
    import torch.distributed as dist

    import zeroshard
    from benchmarks.harness.spec import SIZES
    from benchmarks.harness.systems.base import deepspeed_config
    from benchmarks.harness.systems.engine_loop import EngineLoop
    from benchmarks.harness.workload import batches, build_model, numel_of
    from zeroshard.core.comm import collectives as C

    rank, world = dist.get_rank(), dist.get_world_size()
    link = Link(os.environ["GLOO_SOCKET_IFNAME"]) if rank == 0 else None
    job = _job(args, world, "zeroshard")
    loops: dict[str, Any] = {}
    out: dict[str, Any] = {"variants": {}, "world": world, "local": int(os.environ["LOCAL_WORLD_SIZE"])}
    for name in args.variants:
        model = build_model(job, torch.device("cpu"))
        out["numel"] = numel_of(model)
        cfg = deepspeed_config(job)
        for key, value in VARIANTS[name].items():
            (cfg if key in TOP_LEVEL else cfg["zero_optimization"])[key] = value
        if args.logger:
            cfg["comms_logger"] = {"enabled": True, "prof_all": True}
        try:
            engine, *_ = zeroshard.initialize(model=model, config=cfg)
        except zeroshard.ConfigError as exc:  # NotYetSupportedError too: a key refused
            out["variants"][name] = {"status": "not available", "reason": _reason(exc)}
            continue
        loops[name] = EngineLoop(engine)
        out["variants"][name] = {"status": "ok", "step_s": [], "losses": [], "link": [], "comms": {}}
    names = list(loops)
    steps = args.warmup + args.steps
    data = batches(job, rank, steps, SIZES[args.model].vocab_size)
    attribution = None
    if args.logger:
        attribution = LinkAttribution(C.HOOK.recorder, link)
        C.HOOK.recorder = attribution  # type: ignore[assignment]
    out["barrier_bytes"] = _barrier_bytes(link)
    for i, micro in enumerate(data):
        for name in names[i % len(names):] + names[: i % len(names)]:
            rec = out["variants"][name]
            snap = attribution.snapshot() if attribution else None
            dist.barrier()
            before = link.read() if link else (0, 0)
            t = time.perf_counter()
            loss, _ = loops[name].train_step(micro)
            dist.barrier()
            rec["step_s"].append(time.perf_counter() - t)
            after = link.read() if link else (0, 0)
            rec["link"].append([after[0] - before[0], after[1] - before[1]])
            rec["losses"].append(loss)
            if attribution and snap is not None and i >= args.warmup:
                _delta(attribution.snapshot(), snap, rec["comms"])
        if rank == 0 and (i + 1) % 10 == 0:
            print(f"step {i + 1}/{steps}: " + ", ".join(
                f"{n} {out['variants'][n]['losses'][-1]:.4f} ({out['variants'][n]['step_s'][-1]:.2f} s)"
                for n in names), flush=True)
    C.HOOK.recorder = None  # no exit summary
    if names:  # every step's loss, averaged over the ranks
        losses = torch.tensor([out["variants"][n]["losses"] for n in names], dtype=torch.float64)
        dist.all_reduce(losses)
        for n, row in zip(names, (losses / world).tolist()):
            out["variants"][n]["losses"] = row
    for n in names:
        loops[n].engine.destroy()
    from benchmarks.harness import proc_memory

    out["peak_rss"] = proc_memory.status()["VmHWM"]
    return out


def deepspeed_worker(args: argparse.Namespace) -> dict[str, Any]:
    """DeepSpeed at stage 3, plain and with each ZeRO++ key: a few steps, or the exact error.
    Rank 0 writes what it has after every variant (a hang leaves the earlier ones)."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from benchmarks.harness.spec import SIZES
    from benchmarks.harness.systems.base import deepspeed_config
    from benchmarks.harness.systems.engine_loop import EngineLoop
    from benchmarks.harness.workload import batches, build_model

    rank, world = dist.get_rank(), dist.get_world_size()
    job = _job(args, world, "deepspeed")
    data = batches(job, rank, args.ds_steps, SIZES[args.model].vocab_size)
    out: dict[str, Any] = {"variants": {}, "deepspeed": deepspeed.__version__}
    for name in args.ds_variants:
        cfg = deepspeed_config(job)
        cfg["zero_optimization"].update(DS_VARIANTS[name])
        rec: dict[str, Any] = {"status": "ok", "config": DS_VARIANTS[name]}
        try:
            model = build_model(job, torch.device("cpu"))
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            loop = EngineLoop(engine)
            rec.update(step_s=[], losses=[])
            for micro in data:
                dist.barrier()
                t = time.perf_counter()
                loss, _ = loop.train_step(micro)
                dist.barrier()
                rec["step_s"].append(time.perf_counter() - t)
                rec["losses"].append(loss)
            engine.destroy()
        except Exception as exc:
            tb = traceback.extract_tb(exc.__traceback__)
            rec.update(status="failed", reason=_reason(exc),
                       where=[f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in tb[-4:]])
            if rank == 0:
                traceback.print_exc()
        out["variants"][name] = rec
        if rank == 0:
            _write(args.out_json, out)
        dist.barrier()
    return out


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def worker_main(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = (deepspeed_worker if args.worker == "deepspeed" else train_worker)(args)
    if dist.get_rank() == 0:
        _write(args.out_json, result)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown: a peer left mid-collective must not hang this rank


# -- parent side ------------------------------------------------------------------------------------


def run_job(cluster: Any, phase: str, argv: list[str], timeout: float) -> dict[str, Any]:
    """This file with ``--worker`` on every node of ``cluster``; rank 0's JSON (``status`` added)."""
    from emulated_cluster import torchrun_cluster

    LOGS.mkdir(parents=True, exist_ok=True)
    out = LOGS / f"{phase}.json"
    out.unlink(missing_ok=True)
    t = time.monotonic()
    run = torchrun_cluster(cluster, __file__, [*argv, "--out-json", str(out)], nproc_per_node=2, timeout=timeout)
    (LOGS / f"{phase}.log").write_text(run.describe())
    res: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"variants": {}}
    res["status"] = "ok" if run.ok else ("timed out" if run.timed_out else "failed")
    res["wall_s"] = time.monotonic() - t
    res["link_delta"] = list(run.link_delta)
    res["load"] = os.getloadavg()[0]
    print(f"{phase}: {res['status']} in {res['wall_s']:.0f} s, load {res['load']:.1f} "
          f"(log: {LOGS / f'{phase}.log'})", flush=True)
    return res


def _ok(res: dict[str, Any], name: str) -> dict[str, Any] | None:
    r = res.get("variants", {}).get(name)
    return r if r and r.get("status") == "ok" and r.get("losses") else None


def final_loss(losses: list[float]) -> float:
    """The final loss: the mean of the last :data:`LAST` steps."""
    return statistics.fmean(losses[-LAST:])


def _per_step(comms: dict[str, dict[str, int]], kind: str, steps: int, barrier: float = 0.0) -> dict[str, float]:
    """One kind of the bytes job's per-collective counters, per step, collectives that ran only."""
    calls = comms.get("calls", {})
    return {k: (v - barrier * calls.get(k, 0)) / steps for k, v in comms.get(kind, {}).items()
            if kind == "levels" or calls.get(k, 0) > 0}


def _sum_ops(per_op: dict[str, float], ops: tuple[str, ...], level: str = "") -> float:
    return sum(v for k, v in per_op.items() if k.split(" | ")[0] in ops and k.endswith(level))


def _mib(x: float | None) -> str:
    return "–" if x is None else f"{x / 2**20:,.2f}"


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def draw(parity: dict[str, Any], path: Path, title: str) -> str | None:
    """Loss curves (left) and each variant's difference from plain ZeRO-3 (right); why not drawn, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]')"
    names = [n for n in parity.get("variants", {}) if _ok(parity, n)]
    if PLAIN not in names:
        return "no plain ZeRO-3 run"
    ref = parity["variants"][PLAIN]["losses"]
    colors = {PLAIN: "black", "qwZ": "#1b9e77", "qgZ": "#d95f02", "qwZ+qgZ": "#7570b3"}
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    for n in names:
        losses = parity["variants"][n]["losses"]
        steps = range(1, len(losses) + 1)
        axes[0].plot(steps, losses, lw=1.6 if n == PLAIN else 0.9, ls="--" if n == PLAIN else "-",
                     color=colors.get(n), label=n if n != PLAIN else "plain ZeRO-3", alpha=0.85)
        if n != PLAIN:
            rel = [(a - b) / b * 100 for a, b in zip(losses, ref)]
            smooth = [statistics.fmean(rel[max(0, i - LAST + 1): i + 1]) for i in range(len(rel))]
            axes[1].plot(steps, rel, lw=0.5, color=colors.get(n), alpha=0.3)
            axes[1].plot(steps, smooth, lw=1.6, color=colors.get(n), label=f"{n} (mean of {LAST} steps)")
    axes[0].set(xlabel="step", ylabel="training loss (mean over the 4 ranks)", title="loss per step")
    axes[1].axhline(0, color="black", lw=0.8)
    for y in (-1, 1):
        axes[1].axhline(y, color="gray", lw=0.8, ls=":")
    axes[1].set(xlabel="step", ylabel="(loss − plain) / plain (%)",
                title="difference from plain ZeRO-3, step by step (dotted: ±1%)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _keys(zero: dict[str, Any]) -> str:
    return ", ".join(f"`{k}: {json.dumps(v)}`" + (" (top level)" if k in TOP_LEVEL else "")
                     for k, v in zero.items()) or "(plain stage 3)"


def _status(res: dict[str, Any], n: str) -> str:
    r = res.get("variants", {}).get(n)
    if r is None:
        return "–" if res.get("status") in ("ok", "not run") else f"*{res['status']}*"
    return "ok" if r["status"] == "ok" else f"*{r['status']}*: {r.get('reason', '')}"


def _time_table(args: argparse.Namespace, res: dict[str, Any], warmup: int, rate: str,
                goals: list[tuple[str, str, str, bool | None]] | None) -> list[str]:
    lines = ["| variant | median step (s) | min (s) | quartiles (s) | × plain (same budget) | tokens/s "
             "| on the link (MiB/step) | link use (Gbit/s, both ways) |", "|---|---:|---:|---|---:|---:|---:|---:|"]
    tokens = 4 * args.micro_batch * args.seq_len
    for n in res.get("variants", {}):
        r = _ok(res, n)
        if r is None:
            continue
        m = r["step_s"][warmup:]
        med = statistics.median(m)
        q1, q3 = _quartiles(m)
        ref = _ok(res, reference(n))
        ratio = statistics.median(a / b for a, b in zip(m, ref["step_s"][warmup:])) if ref else None
        link = statistics.median(tx + rx for tx, rx in r["link"][warmup:])
        lines.append(f"| {n} | {med:.3f} | {min(m):.3f} | {q1:.3f}–{q3:.3f} | "
                     f"{'–' if ratio is None else f'{ratio:.3f}'} | {tokens / med:,.0f} | {_mib(link)} | "
                     f"{link * 8 / med / 1e9:.2f} |")
        if goals is not None and ratio is not None and n in ("qwZ+qgZ", "qwZ+qgZ+hpZ/R", "hybrid"):
            target = 1.0 if n == "hybrid" else 0.6
            goals.append((f"{n}: step time ÷ {reference(n)} at {rate}", f"{ratio:.3f}", f"≤ {target}",
                          ratio <= target))
    return lines


def markdown(args: argparse.Namespace, res: dict[str, dict[str, Any]], machine: dict[str, Any],
             loads: list[float], png: Path, png_note: str | None) -> str:
    from benchmarks.harness.machine import allocator_text

    parity, nbytes, timed, extra, ds = (res[k] for k in ("parity", "bytes", "timed", "extra", "deepspeed"))
    numel = next((r["numel"] for r in res.values() if r.get("numel")), 0)
    goals: list[tuple[str, str, str, bool | None]] = []
    rss = max((r.get("peak_rss", 0) for r in res.values()), default=0)
    minutes = sum(r.get("wall_s", 0) for r in res.values()) / 60
    live = RELEASED["stage3_max_live_parameters"]
    lines = [
        "# ZeRO++ (qwZ, qgZ, hpZ) and hybrid sharding on two emulated nodes: loss, bytes across the link, "
        "step time", "",
        f"- Command: `{args.command}` (as root: network namespaces); {minutes:.0f} minutes",
        f"- Date: {machine['date']}; git `{machine['zeroshard_git']}`; torch {machine['torch']}, "
        f"DeepSpeed {machine['deepspeed']}, zeroshard {machine['zeroshard']}, Python {machine['python']}",
        f"- Machine: {machine['cpu']}, {machine['cpu_cores']} cores, {machine['memory_gib']} GiB, "
        f"{machine['os']}; allocator: {allocator_text(machine['allocator'])}; load average (1 min) at the start, "
        "after each job: " + " / ".join(f"{x:.1f}" for x in loads)
        + (" — **taken under contention**: other engineers' test runs shared the 2 cores" if max(loads) > 1.5
           else ""),
        "- Cluster: `tests/emulated_cluster.py`, 2 nodes (network namespaces) × 2 ranks = 4 gloo ranks, "
        "`torchrun --nnodes 2 --nproc-per-node 2` in each (`LOCAL_WORLD_SIZE=2`: zeroshard's topology has two "
        "levels), one OpenMP thread per rank, 4 ranks on 2 cores; the veth link between the nodes unthrottled "
        f"(about 12 Gbit/s) for the parity, bytes and DeepSpeed jobs, throttled with tbf to `{args.rate}` at both "
        "ends (each direction) for the timed job" + (f" and to `{args.extra_rate}` for the extra one"
                                                      if args.extra_rate else ""),
        f"- Workload: GPT {numel / 1e6:.1f}M (`benchmarks/harness/spec.py` `{args.model}`), {args.dtype}, ZeRO "
        "stage 3 with the comparison's config (`harness/systems/base.py`: AdamW lr 1e-4, clipping 1.0, "
        f"buckets of 6,553,600 elements, overlap_comm), micro batch {args.micro_batch} × {args.seq_len} tokens "
        f"per rank (global batch {4 * args.micro_batch} sequences, no accumulation"
        + ("" if (args.micro_batch, args.seq_len) == (4, 64) else "; the comparison's is 4 × 64, made smaller here "
           "so that 200 steps of 4 variants fit the study's time")
        + "), byte-level sonnets, seed 1234; peak RSS of rank 0 "
        f"{rss / 2**20:,.0f} MiB (every variant's engine in one process)",
        "- Pairing: the variants of a job live in the same 4 processes, each on its own model from the same seed, "
        "and train side by side on the same batches, one step each in turn, rotating who goes first "
        "(`harness/paired.py`'s scheme): every variant sees the same machine load",
        f"- `/R`: with `stage3_max_live_parameters` and `stage3_prefetch_bucket_size` {live:,} "
        "(about one block gathered, `results/stage3_knobs.md`'s FSDP2-like "
        "row): units are released after forward and gathered again in backward, the gather that hpZ keeps "
        "inside a node. At the defaults (live 1e9) this model stays gathered from forward to the end of "
        "backward, backward gathers nothing, and hpZ has nothing to do. `/R` variants are compared with "
        "`plain/R`, the others with `plain`",
        "", "## Variants", "",
        "| variant | zero_optimization keys | parity job | bytes job | timed job |", "|---|---|---|---|---|",
    ]
    for n in VARIANTS:
        if any(n in r.get("variants", {}) for r in (parity, nbytes, timed)):
            lines.append(f"| {n} | {_keys(VARIANTS[n])} | {_status(parity, n)} | {_status(nbytes, n)} | "
                         f"{_status(timed, n)} |")

    # 1. loss parity
    ref = _ok(parity, PLAIN)
    steps = len(ref["losses"]) if ref else 0
    lines += ["", f"## 1. Loss parity ({steps} steps, link unthrottled)", "",
              f"Final loss: the mean of the last {LAST} steps' losses (each the mean over the 4 ranks); "
              f"curves in [`{png.name}`]({png.name})" + (f" (not drawn: {png_note})" if png_note else "") + ".", "",
              "| variant | loss, step 1 | step 100 | final loss | relative difference from plain | "
              "largest single-step difference | within 1% |", "|---|---:|---:|---:|---:|---:|---|"]
    for n in parity.get("variants", {}):
        r = _ok(parity, n)
        if r is None:
            continue
        fl, mid = final_loss(r["losses"]), r["losses"][min(99, len(r["losses"]) - 1)]
        if ref is None or n == PLAIN:
            lines.append(f"| {n} | {r['losses'][0]:.4f} | {mid:.4f} | {fl:.4f} | – | – | – |")
            continue
        rel = (fl - final_loss(ref["losses"])) / final_loss(ref["losses"])
        worst = max(abs(a - b) / b for a, b in zip(r["losses"], ref["losses"]))
        ok = abs(rel) <= 0.01
        lines.append(f"| {n} | {r['losses'][0]:.4f} | {mid:.4f} | {fl:.4f} | {rel * 100:+.3f}% | "
                     f"{worst * 100:.2f}% | {'yes' if ok else '**no**'} |")
        goals.append((f"{n}: final loss within 1% of plain ({steps} steps)", f"{rel * 100:+.3f}%", "≤ 1%", ok))
    same = []
    for a, b in SAME:
        ra, rb = _ok(timed, a), _ok(timed, b)
        if ra and rb:
            same.append(f"{a} against {b}: {max(abs(x - y) for x, y in zip(ra['losses'], rb['losses'])):.2g}")
    ra, rb = _ok(timed, "hybrid"), _ok(timed, PLAIN)
    hybrid = (f" Hybrid sharding computes the same sums in another order: its largest relative difference from "
              f"plain in a step's loss there is "
              f"{max(abs(x - y) / y for x, y in zip(ra['losses'], rb['losses'])):.2g}." if ra and rb else "")
    if same:
        lines += ["", f"hpZ is exact (its secondary shards are copies of gathered values): the largest difference "
                  f"in any step's loss over the timed job's {args.timed_warmup + args.timed_rounds} steps, "
                  + "; ".join(same) + "." + hybrid]

    # 2. bytes
    logged_steps = max(args.bytes_steps, 1)
    barrier = nbytes.get("barrier_bytes", 0.0)
    lines += ["", "## 2. Bytes per step", "",
              "**On the link**: node 0's veth `tx_bytes` + `rx_bytes` per step (both directions, Ethernet frames "
              f"with their headers), median over the timed job's {args.timed_rounds} measured steps (no logger; "
              f"the closing barrier's {timed.get('barrier_bytes', 0):,.0f} B included). **Logger**: the bytes job "
              f"({args.bytes_warmup} warm-up + {args.bytes_steps} steps, link unthrottled, `comms_logger` "
              "enabled with `prof_all`), rank 0's `HOOK.recorder.bytes_by_level` per step: each collective "
              "counted as its whole buffer (an all-gather's gathered output, a reduce-scatter's or all-to-all's "
              "input), as DeepSpeed's logger counts it; plain ZeRO-3's collectives span the whole world.", "",
              "| variant | on the link (MiB/step) | × plain (same budget) | logger: world | inside nodes "
              "| across nodes | logger total |", "|---|---:|---:|---:|---:|---:|---:|"]
    link_step: dict[str, float] = {}
    for n in timed.get("variants", {}):
        r = _ok(timed, n)
        if r is not None:
            link_step[n] = statistics.median(tx + rx for tx, rx in r["link"][args.timed_warmup:])
    for n in VARIANTS:
        r = _ok(nbytes, n)
        if r is None and n not in link_step:
            continue
        levels = _per_step(r["comms"], "levels", logged_steps) if r else {}
        on = link_step.get(n)
        base = link_step.get(reference(n))
        lines.append(f"| {n} | {_mib(on)} | {f'{on / base:.3f}' if on is not None and base else '–'} | "
                     + " | ".join(_mib(levels.get(k, 0)) for k in ("world", "inside nodes", "across nodes"))
                     + f" | {_mib(sum(levels.values()))} |")
        if n in ("qwZ+qgZ", "qwZ+qgZ+hpZ/R") and on is not None and base:
            what = "all three (qwZ+qgZ+hpZ)" if "hpZ" in n else "qwZ+qgZ (hpZ has no backward gather to save here)"
            goals.append((f"{what}: bytes on the link per step ÷ {reference(n)} (veth)", f"{on / base:.3f}",
                          "≤ 0.3", on / base <= 0.3))
    lines += ["", "**By collective** (bytes job, per step, MiB): the logger's bytes on rank 0, and what crossed the "
              "link during the collective (node 0's veth, both directions, all 4 ranks' traffic: the study puts a "
              f"world barrier after every logged collective and subtracts one barrier, {barrier:,.0f} B).", "",
              "| variant | collective | calls | logger (rank 0) | on the link |", "|---|---|---:|---:|---:|"]
    parts: dict[str, dict[str, float]] = {}
    for n in VARIANTS:
        r = _ok(nbytes, n)
        if r is None:
            continue
        logged = _per_step(r["comms"], "logged", logged_steps)
        on_link = _per_step(r["comms"], "link", logged_steps, barrier)
        calls = _per_step(r["comms"], "calls", logged_steps)
        for k in sorted(logged, key=lambda k: -logged[k]):
            lines.append(f"| {n} | `{k}` | {calls[k]:.0f} | {_mib(logged[k])} | {_mib(max(on_link.get(k, 0), 0))} |")
        parts[n] = {"gather_logged": _sum_ops(logged, GATHER_OPS), "gather_link": _sum_ops(on_link, GATHER_OPS),
                    "grad_logged": _sum_ops(logged, GRADIENT_OPS), "grad_link": _sum_ops(on_link, GRADIENT_OPS),
                    "grad_across_logged": _sum_ops(logged, GRADIENT_OPS, "across nodes"),
                    "total_link": sum(on_link.values())}
    lines += ["", "Against plain ZeRO-3 with the same live budget (the logger's buffers on rank 0; the link "
              "attribution above):", "",
              "| variant | parameter all-gathers: logger | on the link | gradient collectives: logger "
              "| gradient collectives across nodes: logger¹ | gradient collectives on the link "
              "| all collectives on the link |", "|---|---:|---:|---:|---:|---:|---:|"]

    def x(n: str, key: str, ref_key: str | None = None) -> float | None:
        base = parts.get(reference(n))
        if base is None or n not in parts or not base[ref_key or key]:
            return None
        return parts[n][key] / base[ref_key or key]

    def fx(v: float | None) -> str:
        return "–" if v is None else f"{v:.3f}×"

    for n in parts:
        if n == reference(n):
            continue
        lines.append(f"| {n} | {fx(x(n, 'gather_logged'))} | {fx(x(n, 'gather_link'))} | "
                     f"{fx(x(n, 'grad_logged'))} | {fx(x(n, 'grad_across_logged', 'grad_logged'))} | "
                     f"{fx(x(n, 'grad_link'))} | {fx(x(n, 'total_link'))} |")
    lines += ["", "¹ The gradient collectives filed `| across nodes` (qgZ's 4-bit all-to-all, hybrid sharding's "
              "all-reduce) against plain ZeRO-3's whole reduce-scatter buffer, as "
              "`tests/distributed/test_zeropp.py` measures it; plain ZeRO-3's "
              "reduce-scatter is one collective over the world, so the logger cannot say which part of it "
              "crossed: the link column can."]
    v, w = x("qwZ", "gather_logged"), x("qwZ", "gather_link")
    if v is not None and w is not None:
        goals.append((f"qwZ: parameter all-gather bytes ÷ plain ({args.dtype}), logger / link",
                      f"{v:.3f} / {w:.3f}", "≤ 0.55", max(v, w) <= 0.55))
    w = x("qwZ+qgZ+hpZ/R", "gather_link")
    if w is not None:  # the logger also counts hpZ's bf16 gathers inside the nodes
        goals.append(("qwZ+qgZ+hpZ/R: parameter all-gather bytes on the link ÷ plain/R", f"{w:.3f}", "≤ 0.55",
                      w <= 0.55))
    for n in ("qgZ", "qwZ+qgZ+hpZ/R"):
        v, w = x(n, "grad_link"), x(n, "grad_across_logged", "grad_logged")
        if v is not None:
            goals.append((f"{n}: gradient bytes across the link ÷ {reference(n)}, link / logger¹",
                          f"{v:.3f} / {fx(w).rstrip('×')}", "≤ 0.3", v <= 0.3))

    # 3. time
    lines += ["", f"## 3. Step time, link throttled to {args.rate}", "",
              f"{args.timed_warmup} warm-up + {args.timed_rounds} measured rounds; a step is timed between world "
              "barriers (the slowest rank). × plain: the median over rounds of the ratio of the step to plain "
              "ZeRO-3's (same live budget) of the same round. Link use: the step's bytes on the link (both "
              f"directions together) over its time; the link carries up to {args.rate} each way.", ""]
    lines += _time_table(args, timed, args.timed_warmup, args.rate, goals)
    if extra.get("variants"):
        lines += ["", f"The same with the link at {args.extra_rate} ({args.extra_warmup} warm-up + "
                  f"{args.extra_rounds} rounds; not one of the issue's goals: where the link, not this machine's "
                  "2 cores, sets the pace):", ""]
        lines += _time_table(args, extra, args.extra_warmup, args.extra_rate, None)
    if _ok(timed, "hybrid") is None:
        goals.append(("hybrid sharding: step time ≤ plain ZeRO-3", f"not measured ({_status(timed, 'hybrid')})",
                      "≤ 1.0", None))

    lines += ["", "## The issue's goals", "", "| goal | measured | target | met |", "|---|---|---|---|"]
    for goal, shown, target, met in goals:
        lines.append(f"| {goal} | {shown} | {target} | {'n/a' if met is None else ('yes' if met else '**no**')} |")

    # 4. DeepSpeed
    lines += ["", "## 4. DeepSpeed 0.19.8's ZeRO++ on CPU", "",
              f"The same harness and cluster (link unthrottled), DeepSpeed {ds.get('deepspeed', '?')} at stage 3 "
              f"with the same config plus each key, {args.ds_steps} steps when it initializes (job: "
              f"{ds.get('status', 'not run')}). Its qwZ and qgZ load DeepSpeed's `QuantizerBuilder` op "
              "(`CUDAQuantizer`, `all_to_all_quant_reduce`), which the CPU accelerator does not implement.", "",
              "| variant | keys | result | where (innermost last) |", "|---|---|---|---|"]
    for n in args.ds_variants:
        r = ds.get("variants", {}).get(n)
        if r is None:
            lines.append(f"| {n} | {_keys(DS_VARIANTS[n])} | *not reached* ({ds.get('status', 'not run')}) | |")
        elif r["status"] == "ok":
            lines.append(f"| {n} | {_keys(DS_VARIANTS[n])} | runs: {len(r['losses'])} steps, median "
                         f"{statistics.median(r['step_s']):.2f} s, loss {r['losses'][0]:.4f} → "
                         f"{r['losses'][-1]:.4f} (rank 0) | |")
        else:
            lines.append(f"| {n} | {_keys(DS_VARIANTS[n])} | **{r['status']}**: `{r['reason']}` | "
                         f"{' → '.join(r['where'])} |")
    return "\n".join(lines) + "\n"


NOTES = "\n## Notes"


def _names(text: str, known: dict[str, Any]) -> list[str]:
    names = [v for v in text.split(",") if v]
    bad = [v for v in names if v not in known]
    if bad:
        raise SystemExit(f"unknown variant(s) {', '.join(bad)}; choose from {', '.join(known)}")
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=("train", "deepspeed"), help=argparse.SUPPRESS)
    p.add_argument("--out-json", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--logger", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--model", default="25m", help="GPT size of benchmarks/harness/spec.py")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--variants", default=",".join(DEFAULT),
                   help=f"the bytes and timed jobs' variants, of {', '.join(VARIANTS)}")
    p.add_argument("--parity-variants", default=",".join(PARITY))
    p.add_argument("--parity-steps", type=int, default=200)
    p.add_argument("--bytes-warmup", type=int, default=1)
    p.add_argument("--bytes-steps", type=int, default=2)
    p.add_argument("--timed-warmup", type=int, default=2)
    p.add_argument("--timed-rounds", type=int, default=8)
    p.add_argument("--rate", default="1gbit", help="tc rate of the link in the timed job")
    p.add_argument("--extra-rate", default="200mbit", help="a second timed job at this rate ('' skips it)")
    p.add_argument("--extra-variants", default=",".join(EXTRA))
    p.add_argument("--extra-warmup", type=int, default=1)
    p.add_argument("--extra-rounds", type=int, default=4)
    p.add_argument("--ds-variants", default=",".join(DS_VARIANTS), help="'' skips DeepSpeed")
    p.add_argument("--ds-steps", type=int, default=3)
    p.add_argument("--phases", default="parity,bytes,deepspeed,timed,extra")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per torchrun job")
    p.add_argument("--out", type=Path, default=RESULTS / "zeropp.md")
    args = p.parse_args(argv)
    args.ds_variants = _names(args.ds_variants, DS_VARIANTS)
    if args.worker:
        args.variants = _names(args.variants, VARIANTS if args.worker == "train" else DS_VARIANTS)
        return worker_main(args)
    args.command = " ".join(["python benchmarks/studies/zeropp.py", *(sys.argv[1:] if argv is None else argv)])
    sys.path.insert(0, str(ROOT / "tests"))
    from emulated_cluster import EmulatedCluster, available

    from benchmarks.harness.machine import describe

    ok, why = available()
    if not ok:
        raise SystemExit(f"the emulated cluster cannot be built here: {why}")
    phases = set(args.phases.split(","))
    common = ["--model", args.model, "--dtype", args.dtype, "--micro-batch", str(args.micro_batch),
              "--seq-len", str(args.seq_len)]

    def train(variants: str, warmup: int, steps: int, *more: str) -> list[str]:
        _names(variants, VARIANTS)
        return ["--worker", "train", *common, "--variants", variants, "--warmup", str(warmup),
                "--steps", str(steps), *more]

    machine, loads = describe(), [os.getloadavg()[0]]
    res: dict[str, dict[str, Any]] = {k: {"status": "not run", "variants": {}}
                                      for k in ("parity", "bytes", "deepspeed", "timed", "extra")}
    with EmulatedCluster(rate=None, prefix="zsbench") as cluster:
        if "parity" in phases:
            res["parity"] = run_job(cluster, "parity", train(args.parity_variants, 0, args.parity_steps),
                                    args.timeout)
            loads.append(res["parity"]["load"])
        if "bytes" in phases:
            res["bytes"] = run_job(cluster, "bytes", train(args.variants, args.bytes_warmup, args.bytes_steps,
                                                           "--logger"), args.timeout)
            loads.append(res["bytes"]["load"])
        if "deepspeed" in phases and args.ds_variants:
            res["deepspeed"] = run_job(cluster, "deepspeed", [
                "--worker", "deepspeed", *common, "--variants", ",".join(args.ds_variants),
                "--ds-variants", ",".join(args.ds_variants), "--ds-steps", str(args.ds_steps)], min(args.timeout, 900))
            loads.append(res["deepspeed"]["load"])
    for phase, rate, variants, warmup, rounds in (
            ("timed", args.rate, args.variants, args.timed_warmup, args.timed_rounds),
            ("extra", args.extra_rate, args.extra_variants, args.extra_warmup, args.extra_rounds)):
        if phase in phases and rate:
            with EmulatedCluster(rate=rate, prefix="zsbench") as cluster:
                res[phase] = run_job(cluster, phase, train(variants, warmup, rounds), args.timeout)
                loads.append(res[phase]["load"])
    (LOGS / "results.json").write_text(json.dumps(res))
    png = args.out.with_name(args.out.stem + "_loss.png")
    title = (f"GPT {res['parity'].get('numel', 0) / 1e6:.1f}M, {args.dtype}, ZeRO-3, 2 emulated nodes × 2 gloo "
             f"ranks, micro batch {args.micro_batch} × {args.seq_len} tokens per rank")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    note = draw(res["parity"], png, title)
    from benchmarks.harness.report import kept_notes
    text = markdown(args, res, machine, loads, png, note) + kept_notes(args.out, NOTES)
    args.out.write_text(text)
    print(text)
    print(f"wrote {args.out}" + ("" if note else f" and {png}"))
    return 1 if any(r["status"] not in ("ok", "not run") for r in res.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
