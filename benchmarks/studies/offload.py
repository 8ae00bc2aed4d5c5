"""Offload side by side with DeepSpeed: CPU and NVMe optimizer (and ZeRO-3 parameter) offload.

    python benchmarks/studies/offload.py                         # GPT 25M, 2 gloo ranks, fp32: about 6-10 minutes
    python benchmarks/studies/offload.py --systems zeroshard --steps 3 --out /tmp/offload.md
    python benchmarks/studies/offload.py --model 124m --sub-group 0 --variants 2,2+nvme --out /tmp/defaults.md

Every (system, variant) trains the benchmark's GPT (``benchmarks/harness/workload.py``; ``--model``
picks its size from ``benchmarks/harness/spec.py``: the 25M model of ``run.py`` by default, ``124m``
GPT-2 small's shape) from the same seed on the same batches, in fresh spawned processes (so each
peak RSS is its own). Variants: in-memory stage 2 and 3; optimizer offload to CPU at stage 2 and 3
(+ parameters to CPU at stage 3); optimizer offload to NVMe at stage 2 and 3 (+ parameters to NVMe
at stage 3), with ``sub_group_size`` ``--sub-group`` (2e6 by default: several sub-groups per rank;
0 leaves it unset, as a DeepSpeed-default config does: zeroshard then chooses it from the shard,
DeepSpeed uses 1e9) for both systems. zeroshard and DeepSpeed 0.19.8 get the same DeepSpeed-schema config, except that
DeepSpeed's offload variants use its own CPU optimizer (``DeepSpeedCPUAdam``, what its offload
runs by default; in memory both use torch's fused AdamW, as in ``run.py``).

Reported per run: median step time after warm-up (the slowest rank: steps are timed between
barriers), CPU time per step, the forward / backward / optimizer phases, peak RSS per rank, swap
bytes read and written per step (zeroshard: its I/O engines' counters, ``store.io`` and the
parameter swap file's ``io``; both systems: the block-device bytes of the rank processes from
``/proc/self/io``; DeepSpeed also: an estimate from its state sizes), the I/O bound (both ranks'
bytes per step ÷ the bandwidth ``disk_bandwidth.measure`` gives on the same directory in this run),
bytes on disk, the final loss, and the relative distance of each offloaded run's parameters to the
in-memory run of the same system and stage. Then the issue's ratios against their targets.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/studies/offload.py`: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from benchmarks.harness import proc_memory

GiB = float(1 << 30)
MiB = float(1 << 20)
SYSTEMS = ("zeroshard", "deepspeed")


@dataclass(frozen=True)
class Variant:
    """Where optimizer state and (stage 3) parameters live."""

    stage: int
    optimizer: str = "none"  # offload_optimizer.device
    params: str = "none"  # offload_param.device

    @property
    def name(self) -> str:
        if self.optimizer == "none":
            return f"{self.stage}"
        return f"{self.stage}+{self.optimizer}" + (" (+params)" if self.params != "none" else "")

    @property
    def reference(self) -> Variant:
        """The in-memory run of the same stage."""
        return Variant(self.stage)


VARIANTS = (Variant(2), Variant(3), Variant(2, "cpu"), Variant(3, "cpu", "cpu"), Variant(2, "nvme"),
            Variant(3, "nvme", "nvme"))


def config(system: str, v: Variant, job: Any, nvme: Path, sub_group: int) -> dict[str, Any]:
    """The shared DeepSpeed-schema config of ``run.py`` with ``v``'s offload blocks."""
    from benchmarks.harness.systems.base import deepspeed_config

    cfg = deepspeed_config(job)
    z = cfg["zero_optimization"]
    if v.optimizer != "none":
        z["offload_optimizer"] = {"device": v.optimizer, "nvme_path": str(nvme)}
        if system == "deepspeed":  # its offload path: DeepSpeedCPUAdam, not torch's AdamW
            for k in ("torch_adam", "fused"):
                cfg["optimizer"]["params"].pop(k)
    if v.params != "none":
        z["offload_param"] = {"device": v.params, "nvme_path": str(nvme)}
    if "nvme" in (v.optimizer, v.params) and sub_group > 0:  # 0: unset, each system's default
        z["sub_group_size"] = sub_group
    return cfg


def _proc_io() -> tuple[int, int]:
    """Bytes this process (all threads) has read from / written to block devices."""
    with open("/proc/self/io") as f:
        d = dict(line.split(": ") for line in f.read().splitlines() if ": " in line)
    return int(d["read_bytes"]), int(d["write_bytes"])


def _engine_io(engine: Any) -> tuple[int, int, float] | None:
    """zeroshard: bytes its NVMe I/O engines have read and written (optimizer store + parameter
    swap file), and the seconds they had a transfer running (summed over the two engines)."""
    opt = getattr(engine, "optimizer", None)
    swap = getattr(getattr(opt, "shard", None), "swap", None)
    found: list[Any] = [getattr(getattr(opt, "store", None), "io", None), getattr(swap, "io", None)]
    engines = [e for e in found if hasattr(e, "bytes_read")]
    if not engines:
        return None
    return (sum(e.bytes_read for e in engines), sum(e.bytes_written for e in engines),
            sum(getattr(e, "busy_seconds", 0.0) for e in engines))  # 0: an older zeroshard (A/B runs)


def _store_layout(engine: Any) -> tuple[int, int, int] | None:
    """zeroshard's NVMe optimizer store on this rank: (sub-groups, elements of the largest, sub-group
    buffers it keeps in host memory)."""
    store = getattr(getattr(engine, "optimizer", None), "store", None)
    subgroups, slots = getattr(store, "subgroups", None), getattr(store, "slots", None)
    if not subgroups or slots is None:
        return None
    return len(subgroups), max(sg.numel for sg in subgroups), len(slots)


def _peak_rss() -> int:
    """This process's peak resident bytes (``VmHWM``: unlike ``ru_maxrss``, not inherited from the
    process that spawned it, across ``exec``)."""
    return proc_memory.status()["VmHWM"]


def _disk_bytes(root: Path) -> int:
    """Bytes allocated on disk under ``root`` (all ranks' swap files)."""
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def _full_params(lib: Any, module: torch.nn.Module) -> torch.Tensor:
    """Every parameter, whole, flattened in order (a collective under ZeRO-3)."""
    params = list(module.parameters())
    with lib.zero.GatheredParameters(params):
        return torch.cat([p.detach().reshape(-1).float().clone() for p in params])


def worker(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of one (system, variant) run; rank 0's dict comes back to the parent."""
    import torch.distributed as dist

    from benchmarks.harness.spec import SIZES, Job, Workload
    from benchmarks.harness.systems.engine_loop import EngineLoop
    from benchmarks.harness.workload import batches, build_model

    v = Variant(**spec["variant"])
    job = Job(spec["system"], v.stage, spec["model"], world_size=world,
              workload=Workload(micro_batch=spec["micro_batch"], seq_len=spec["seq_len"],
                                warmup_steps=spec["warmup"], measure_steps=spec["steps"]))
    lib: Any = __import__(spec["system"])
    data = batches(job, rank, spec["warmup"] + spec["steps"], SIZES[spec["model"]].vocab_size)
    model = build_model(job, torch.device("cpu"))
    cfg = config(spec["system"], v, job, Path(spec["nvme"]), spec["sub_group"])
    try:
        engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    except Exception as exc:
        # A feature the system does not have is recorded (every rank fails alike); any other error
        # of zeroshard's fails the run.
        if spec["system"] == "zeroshard" and type(exc).__name__ != "NotYetSupportedError":
            raise
        return {"status": "not available", "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    loop = EngineLoop(engine)
    times, cpu, losses, phases = [], [], [], []
    io0: tuple[int, int, float] | None = None
    proc0 = (0, 0)
    for i, micro in enumerate(data):
        if i == spec["warmup"]:
            io0, proc0 = _engine_io(engine), _proc_io()
        dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        loss, _ = loop.train_step(micro)
        dist.barrier()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        losses.append(loss)
        phases.append(dict(loop.phases.seconds))
    n = spec["steps"]
    io1, proc1 = _engine_io(engine), _proc_io()
    counters = torch.tensor([
        *(((io1[0] - io0[0]) / n, (io1[1] - io0[1]) / n, (io1[2] - io0[2]) / n) if io1 and io0 else (-1.0,) * 3),
        (proc1[0] - proc0[0]) / n, (proc1[1] - proc0[1]) / n, _peak_rss()], dtype=torch.float64)
    everyone = [torch.zeros_like(counters) for _ in range(world)]
    dist.all_gather(everyone, counters)
    disk = _disk_bytes(Path(spec["nvme"]))
    layout = _store_layout(engine)
    full = _full_params(lib, engine.module)
    if spec["system"] == "zeroshard":
        engine.destroy()  # removes its swap files (DeepSpeed's are removed by the parent)
    measured = times[spec["warmup"]:]
    per_rank = torch.stack(everyone).tolist()
    return {
        "status": "ok", "step_s": statistics.median(measured), "step_s_min": min(measured),
        "step_s_all": times, "cpu_s": statistics.median(cpu[spec["warmup"]:]), "losses": losses,
        "phases_s": {k: statistics.median(p[k] for p in phases[spec["warmup"]:]) for k in phases[-1]},
        "engine_io": [r[:2] for r in per_rank] if per_rank[0][0] >= 0 else None,
        "io_busy_s": max(r[2] for r in per_rank) if per_rank[0][0] >= 0 else None,
        "proc_io": [r[3:5] for r in per_rank], "peak_rss": [r[5] for r in per_rank], "disk_bytes": disk,
        "numel": int(full.numel()), "params": full if rank == 0 else None, "store_layout": layout,
    }


def deepspeed_estimate(v: Variant, numel: int, world: int) -> tuple[float, float]:
    """Bytes DeepSpeed's NVMe offload must read and write per step, all ranks, from its state sizes
    (fp32): the master and Adam's two moments in and out once per step (12 B per element each way),
    and with parameters on NVMe each parameter shard read once and written once after the step
    (4 + 4). Swapping fp32 gradients through files (sub-groups whose gradients it cannot hold),
    or reading a parameter again in backward, would add to this: a lower estimate."""
    shard = -(-numel // world) * world
    per_elem = 12.0 + (4.0 if v.params == "nvme" else 0.0)
    return per_elem * shard, per_elem * shard


def run_one(system: str, v: Variant, args: argparse.Namespace) -> dict[str, Any]:
    """One fresh 2-rank run; failures are recorded, not raised."""
    from benchmarks.harness.spawned import run_on_ranks

    nvme = args.nvme_path / f"{system}-s{v.stage}-{v.optimizer}-{v.params}"
    shutil.rmtree(nvme, ignore_errors=True)
    nvme.mkdir(parents=True)
    spec = {"system": system, "variant": vars(v), "warmup": args.warmup, "steps": args.steps, "nvme": str(nvme),
            "sub_group": args.sub_group, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
            "model": args.model}
    t = time.monotonic()
    try:
        r = run_on_ranks(worker, args.world_size, spec)
    except Exception as exc:
        r = {"status": "failed", "reason": f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"}
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    r.update(system=system, variant=v, wall_s=time.monotonic() - t, load=os.getloadavg()[0])
    if r["status"] == "ok":
        io = r["engine_io"] or r["proc_io"]
        rd, wr = sum(x[0] for x in io), sum(x[1] for x in io)
        if system == "deepspeed" and "nvme" in (v.optimizer, v.params):
            r["estimate"] = deepspeed_estimate(v, r["numel"], args.world_size)
        r["io_per_step"] = (rd, wr)
    return r


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm())


def _ratio(num: dict[str, Any] | None, den: dict[str, Any] | None, key: str = "step_s") -> float | None:
    if not num or not den or num["status"] != "ok" or den["status"] != "ok" or not den.get(key):
        return None
    return float(num["step_s"] / den[key])


def _cpu_ratio(num: dict[str, Any] | None, den: dict[str, Any] | None) -> float | None:
    """The same ratio in CPU seconds per step (rank 0, all threads), which other load inflates less."""
    if not num or not den or num["status"] != "ok" or den["status"] != "ok" or num is den:
        return None
    return float(num["cpu_s"] / den["cpu_s"])


def ratios(runs: dict[tuple[str, Variant], dict[str, Any]]) -> list[tuple[str, str, float | None, float]]:
    """(goal, run, measured ratio or None, target) for the issue's four offload goals."""
    out: list[tuple[str, str, float | None, float]] = []
    for v in (Variant(2, "cpu"), Variant(3, "cpu", "cpu")):
        out.append(("zeroshard CPU offload ÷ DeepSpeed CPU offload", v.name,
                    _ratio(runs.get(("zeroshard", v)), runs.get(("deepspeed", v))), 0.9))
    for v in (Variant(2, "cpu"), Variant(3, "cpu", "cpu")):
        out.append(("zeroshard CPU offload ÷ zeroshard in memory", v.name,
                    _ratio(runs.get(("zeroshard", v)), runs.get(("zeroshard", v.reference))), 1.15))
    for v in (Variant(2, "nvme"), Variant(3, "nvme", "nvme")):
        r = runs.get(("zeroshard", v))
        out.append(("zeroshard NVMe offload ÷ its I/O bound", v.name, _ratio(r, r, "io_bound_s"), 1.5))
    for v in (Variant(2, "nvme"), Variant(3, "nvme", "nvme")):
        ds = runs.get(("deepspeed", v))
        if ds and ds["status"] == "ok" and not swapped(ds):
            out.append(("zeroshard NVMe offload ÷ DeepSpeed NVMe offload", f"{v.name} (DeepSpeed: {NO_SWAP})", None,
                        0.9))
            continue
        out.append(("zeroshard NVMe offload ÷ DeepSpeed NVMe offload", v.name,
                    _ratio(runs.get(("zeroshard", v)), ds), 0.9))
    return out


NO_SWAP = "no swap file written, its stages 1-2 run `nvme` as CPU offload"


def swapped(r: dict[str, Any]) -> bool:
    """Whether a run moved any bytes to or from the block device (an NVMe run that did not, did not swap)."""
    return sum(x[0] + x[1] for x in r["proc_io"]) > 0


def _gib(x: float) -> str:
    return f"{x / GiB:.2f}"


def markdown(runs: dict[tuple[str, Variant], dict[str, Any]], args: argparse.Namespace,
             bandwidth: list[tuple[float, float]], loads: tuple[float, float]) -> str:
    """The results file: runs, ratios against targets, parity."""
    import deepspeed

    import zeroshard
    from benchmarks.harness.machine import describe

    git = describe()["zeroshard_git"]

    rb, wb = (statistics.mean(b[i] for b in bandwidth) for i in (0, 1))
    numel = next((r["numel"] for r in runs.values() if r["status"] == "ok"), 0)
    sub_group = (f"`sub_group_size` {args.sub_group:.0e} for both systems (about "
                 f"{-(-numel // args.world_size // args.sub_group)} sub-groups per rank)" if args.sub_group > 0 else
                 "`sub_group_size` unset for both systems (zeroshard chooses it from the shard, "
                 "`policy.resolve_sub_group_size`; DeepSpeed uses its default 1e9)")
    lines = [
        "# Offload: zeroshard vs DeepSpeed (CPU and NVMe)", "",
        f"- Command: `{args.command}`",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M')}; torch {torch.__version__}, DeepSpeed {deepspeed.__version__}, "
        f"zeroshard {getattr(zeroshard, '__version__', '?')} (git {git}); {os.cpu_count()} CPU cores",
        f"- Load average (1 min) at start / end: {loads[0]:.2f} / {loads[1]:.2f}"
        + (" — **taken under contention** (other jobs shared the 2 cores)" if max(loads) > 1.5 else ""),
        f"- Workload: GPT {numel // 1_000_000}M (benchmarks/harness/spec.py `{args.model}`), {args.world_size} gloo "
        f"ranks, fp32, micro batch "
        f"{args.micro_batch} × {args.seq_len} tokens, AdamW, clipping 1.0; {args.warmup} warm-up + {args.steps} "
        "measured steps, median step (slowest rank, between barriers)"
        + (f"; every run {args.repeat} times in fresh processes, in alternating order, steps pooled"
           if args.repeat > 1 else ""),
        f"- NVMe variants: {sub_group}; aio defaults (1 MiB blocks, "
        f"queue depth 8, 1 thread); swap files under `{args.nvme_path}`",
        f"- Disk bandwidth on that directory (`disk_bandwidth.measure`, 1 thread, 1 MiB blocks, O_DIRECT, "
        f"{args.bw_gib:g} GiB), before / after the runs: read {bandwidth[0][0]:.2f} / {bandwidth[-1][0]:.2f} GiB/s, "
        f"write {bandwidth[0][1]:.2f} / {bandwidth[-1][1]:.2f} GiB/s; the I/O bound uses the means, read {rb:.2f} "
        f"and write {wb:.2f} GiB/s, and both ranks' bytes (they share the disk): "
        "bound = bytes read ÷ read bandwidth + bytes written ÷ write bandwidth",
        "", "| system | stage + offload | step (s) | min (s) | CPU s/step | fwd / bwd / opt (s) | peak RSS MiB/rank "
        "| swap GiB/step read / write (both ranks) | block-device GiB/step read / write | I/O bound (s) "
        "| step ÷ bound | I/O busy (s) | step ÷ busy | on disk GiB | final loss |",
        "|---|---|---:|---:|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (system, v), r in runs.items():
        if r["status"] != "ok":
            lines.append(f"| {system} | {v.name} | *{r['status']}* | | | | | | | | | | | | |")
            continue
        ph = r["phases_s"]
        nvme = "nvme" in (v.optimizer, v.params)
        pr = [sum(x[i] for x in r["proc_io"]) for i in (0, 1)]
        if r["engine_io"]:
            swap = f"{_gib(r['io_per_step'][0])} / {_gib(r['io_per_step'][1])}"
        elif nvme and not swapped(r):
            swap, nvme = f"none: {NO_SWAP}", False
        elif "estimate" in r:
            swap = f"≈ {_gib(r['estimate'][0])} / {_gib(r['estimate'][1])} (estimate)"
        else:
            swap = "–"
        bound = f"{r['io_bound_s']:.3f}" if nvme else "–"
        vs = f"{r['step_s'] / r['io_bound_s']:.2f}" if nvme and r["io_bound_s"] > 0 else "–"
        busy = r.get("io_busy_s") if nvme else None
        busy_s, vs_busy = (f"{busy:.3f}", f"{r['step_s'] / busy:.2f}") if busy else ("–", "–")
        lines.append(
            f"| {system} | {v.name} | {r['step_s']:.3f} | {r['step_s_min']:.3f} | {r['cpu_s']:.2f} | "
            f"{ph['forward']:.2f} / {ph['backward']:.2f} / {ph['optimizer']:.2f} | "
            f"{max(r['peak_rss']) / MiB:,.0f} | {swap} | {_gib(pr[0])} / {_gib(pr[1])} | {bound} | {vs} | "
            f"{busy_s} | {vs_busy} | "
            f"{r['disk_bytes'] / GiB:.2f} | {r['losses'][-1]:.4f} |")
    lines += ["", "For zeroshard the swap bytes are its I/O engines' counters and the bound uses them; for DeepSpeed "
              "the bound uses the block-device bytes its rank processes moved (`/proc/self/io`), with the "
              "estimate from its state sizes beside them. I/O busy: per step, the seconds zeroshard's I/O "
              "engines had a transfer running (slowest rank), that is the same bytes at the bandwidth the "
              "disk delivered during the run rather than in the measurements before and after it; a step "
              "÷ busy near 1 is a step as short as that disk allowed.", ""]
    for (system, v), r in runs.items():
        if r["status"] != "ok":
            lines.append(f"- {system} {v.name}: **{r['status']}**: {r.get('reason', '')}")
    lines += ["", "Peak RSS of each rank (MiB), and zeroshard's NVMe optimizer store on rank 0: sub-groups, "
              "elements of the largest, sub-group buffers held in host memory.", "",
              "| system | stage + offload | peak RSS per rank (MiB) | sub-groups | largest | buffers |",
              "|---|---|---|---:|---:|---:|"]
    for (system, v), r in runs.items():
        if r["status"] == "ok":
            sg = r.get("store_layout")
            cells = f"{sg[0]} | {sg[1]:,} | {sg[2]}" if sg else "– | – | –"
            lines.append(f"| {system} | {v.name} | {' / '.join(f'{x / MiB:,.0f}' for x in r['peak_rss'])} | {cells} |")
    lines += ["", "## Ratios against the issue's targets", "",
              "Step-time ratios; beside them the same ratio in CPU seconds per step (rank 0), which the other "
              "jobs on the machine distort less (the runs are minutes apart, under different loads).", "",
              "| goal | run | measured | CPU-time ratio | target | met |", "|---|---|---:|---:|---:|---|"]
    pairs = {"DeepSpeed": "deepspeed", "in memory": "zeroshard"}
    for goal, name, value, target in ratios(runs):
        v = next(x for x in VARIANTS if name.startswith(x.name + " ") or name == x.name)
        other = next((sys_ for k, sys_ in pairs.items() if k in goal), None)
        cpu = None
        if other is not None:
            ref = v if other == "deepspeed" else v.reference
            cpu = _cpu_ratio(runs.get(("zeroshard", v)), runs.get((other, ref)))
        met = "n/a" if value is None else ("yes" if value <= target else "**no**")
        lines.append(f"| {goal} | {name} | {'–' if value is None else f'{value:.2f}'} | "
                     f"{'–' if cpu is None or value is None else f'{cpu:.2f}'} | ≤ {target} | {met} |")
    lines += ["", "## Parity: ‖w − w_ref‖ / ‖w_ref‖ after the last step", "",
              "w_ref: the same system's in-memory run of the same stage, and for NVMe its CPU-offload run of "
              "the same stage (for DeepSpeed the same optimizer, DeepSpeedCPUAdam; its in-memory run uses "
              "torch's fused AdamW, whose rounding differs).", "",
              "| system | stage + offload | vs in memory | vs CPU offload |", "|---|---|---:|---:|"]
    for (system, v), r in runs.items():
        if "distance" in r:
            vs_cpu = f"{r['distance_cpu']:.3g}" if "distance_cpu" in r else "–"
            lines.append(f"| {system} | {v.name} | {r['distance']:.3g} | {vs_cpu} |")
    return "\n".join(lines) + "\n"


NOTES = "\n## What limits each"


def _merge(reps: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Repeats of one run: measured steps pooled (median), CPU time median, the largest peak RSS; the
    I/O bytes of the first (every repeat moves the same bytes)."""
    ok = [r for r in reps if r["status"] == "ok"]
    if len(ok) < len(reps) or len(ok) == 1:
        return next((r for r in reps if r["status"] != "ok"), reps[0])
    steps = [t for r in ok for t in r["step_s_all"][warmup:]]
    merged = dict(ok[0])
    merged.update(step_s=statistics.median(steps), step_s_min=min(steps),
                  cpu_s=statistics.median(r["cpu_s"] for r in ok), repeats=len(ok),
                  io_busy_s=statistics.median(r["io_busy_s"] for r in ok) if ok[0]["io_busy_s"] else None,
                  peak_rss=[max(x) for x in zip(*(r["peak_rss"] for r in ok))],
                  phases_s={k: statistics.median(r["phases_s"][k] for r in ok) for k in ok[0]["phases_s"]})
    return merged


def run_all(args: argparse.Namespace, order: list[tuple[Variant, str]]) -> dict[tuple[str, Variant], dict[str, Any]]:
    """Every (variant, system) ``args.repeat`` times, alternating the order; then the parity distances
    (each run's final parameters against its references; runs are deterministic, the first repeat's
    parameters are used)."""
    reps: dict[tuple[str, Variant], list[dict[str, Any]]] = {}
    params: dict[tuple[str, Variant], torch.Tensor] = {}
    for rep in range(args.repeat):
        for v, system in order if rep % 2 == 0 else order[::-1]:
            r = run_one(system, v, args)
            p = r.pop("params", None)
            if p is not None:
                params.setdefault((system, v), p)
            reps.setdefault((system, v), []).append(r)
            print(f"{system} {v.name}: " + (f"{r['step_s']:.3f} s/step, loss {r['losses'][-1]:.4f}"
                                             if r["status"] == "ok" else f"{r['status']}: {r.get('reason')}")
                  + f" ({r['wall_s']:.0f} s, load {r['load']:.1f})", flush=True)
    runs = {k: _merge(rs, args.warmup) for k, rs in reps.items()}
    for (system, v), r in runs.items():
        mine = params.get((system, v))
        ref = params.get((system, v.reference))
        cpu = params.get((system, Variant(v.stage, "cpu", "cpu" if v.stage == 3 else "none")))
        if mine is None or v.optimizer == "none":
            continue
        if ref is not None:
            r["distance"] = _rel(mine, ref)
        if cpu is not None and v.optimizer == "nvme":  # DeepSpeed: the same CPU Adam as its NVMe run
            r["distance_cpu"] = _rel(mine, cpu)
    return runs


def main(argv: list[str] | None = None) -> int:
    """Measure the disk, run every (variant, system), write the report."""
    from benchmarks.harness.spec import SIZES
    from benchmarks.studies.disk_bandwidth import measure

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: zeroshard,deepspeed")
    p.add_argument("--variants", default="", help="comma-separated names (e.g. '2,2+cpu'); default: all")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64,
                   help="tokens per sequence (small values make the step I/O-bound, as on a GPU)")
    p.add_argument("--model", choices=sorted(SIZES), default="25m",
                   help="the GPT size (benchmarks/harness/spec.py; 124m: GPT-2 small's shape)")
    p.add_argument("--sub-group", type=int, default=2_000_000,
                   help="sub_group_size of the NVMe variants; 0 leaves it unset (each system's default)")
    p.add_argument("--nvme-path", type=Path, default=Path("/tmp/zeroshard-offload-bench"))
    p.add_argument("--bw-gib", type=float, default=1.0, help="GiB written and read to measure the disk")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the list this many times, reversing the order every other time, and pool the steps")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "offload.md")
    args = p.parse_args(argv)
    args.command = " ".join(["python benchmarks/studies/offload.py", *(sys.argv[1:] if argv is None else argv)])
    systems = [s for s in args.systems.split(",") if s]
    wanted = [s.strip() for s in args.variants.split(",") if s.strip()]
    unknown = [w for w in wanted if w not in {v.name for v in VARIANTS}]
    if unknown:
        raise SystemExit(f"--variants: unknown {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(repr(v.name) for v in VARIANTS)}")
    variants = [v for v in VARIANTS if not wanted or v.name in wanted]
    args.nvme_path.mkdir(parents=True, exist_ok=True)
    loads = [os.getloadavg()[0]]
    bandwidth = [measure(args.nvme_path, int(args.bw_gib * GiB), 1, 1 << 20)]
    print(f"disk: read {bandwidth[0][0]:.2f} GiB/s, write {bandwidth[0][1]:.2f} GiB/s", flush=True)
    runs = run_all(args, [(v, system) for v in variants for system in systems])
    bandwidth.append(measure(args.nvme_path, int(args.bw_gib * GiB), 1, 1 << 20))
    loads.append(os.getloadavg()[0])
    # the I/O bound with the mean of the two bandwidth measurements
    rb, wb = (statistics.mean(b[i] for b in bandwidth) for i in (0, 1))
    for r in runs.values():
        if r["status"] == "ok":
            r["io_bound_s"] = r["io_per_step"][0] / (rb * GiB) + r["io_per_step"][1] / (wb * GiB)
    from benchmarks.harness.report import kept_notes
    text = markdown(runs, args, bandwidth, (loads[0], loads[-1])) + kept_notes(args.out, NOTES)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    print(f"wrote {args.out}")
    return 1 if any(r["status"] == "failed" for (s, _), r in runs.items() if s == "zeroshard") else 0


if __name__ == "__main__":
    sys.exit(main())
