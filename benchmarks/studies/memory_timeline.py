"""Where a training step's bytes go: live tensor bytes by category against what the process holds.

    python benchmarks/studies/memory_timeline.py --system zeroshard --stage 3 [--zero JSON]
    python benchmarks/studies/memory_timeline.py --system ddp
    python benchmarks/studies/memory_timeline.py --system zeroshard --stage 3 --device cuda --snapshot /tmp/z3.pickle

Trains the benchmark's GPT (``benchmarks/harness/workload.py``) on ``--world-size`` spawned gloo ranks
(NCCL with ``--device cuda``) for ``--warmup`` steps, then samples one step: before and after every
module's forward (forward hooks), after every parameter's gradient is accumulated (backward), and
around each micro-step's forward, backward and the optimizer step. Each sample holds

- live tensor bytes by category (on CPU, the storage's resident pages: a released ZeRO-3 unit's
  mapping and a master row lent to a gathered unit keep their size but hold nothing), each storage
  counted once, in this order of precedence:
  ``parameters`` (the module's, or ZeRO-3's shard), ``gathered`` (ZeRO-3 units gathered now, and
  all-gathers in flight), ``gradients`` (``.grad`` and the stage's accumulator), ``comm``
  (reduce buckets, all-gather buffers), ``master`` (fp32 master shard), ``optimizer`` (the torch
  optimizer's state), ``activations`` (tensors autograd saved for backward, not counted above);
- on CPU: the process's RSS and its peak so far (``/proc/self/status``), and the bytes glibc's
  malloc has handed out (``mallinfo2``: in-use heap plus mmapped blocks), so
  ``RSS - malloc`` is what the allocator keeps without any live allocation, and ``free kept``,
  the free bytes inside malloc's arenas (``mallinfo2``), which glibc holds for later allocations
  (the main arena is not always ``[heap]``: when ``brk`` cannot grow it, glibc extends it with
  anonymous mappings);
- on CUDA: ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` / ``memory_reserved``, and
  with ``--snapshot`` a ``torch.cuda.memory`` snapshot of the step (open it at
  https://pytorch.org/memory_viz).

All figures are growth over a baseline taken just before the model is built. The report (rank 0's
samples, and every rank's peak) goes to stdout and, with ``--out``, to a Markdown file.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from benchmarks.harness import proc_memory

CATEGORIES = ("parameters", "gathered", "gradients", "comm", "master", "optimizer", "activations")
MiB = 2**20


# -- process-level readings ------------------------------------------------------------------
class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
        if lib is not None:
            lib.mallinfo2.restype = _MallInfo2
        return lib
    except (OSError, AttributeError):  # not glibc, or glibc < 2.33
        return None


_LIBC = _libc()


def process_bytes(device: torch.device) -> dict[str, int]:
    """RSS, peak RSS and malloc's live bytes (CPU), or the CUDA allocator's counters."""
    if device.type == "cuda":
        return {"allocated": torch.cuda.memory_allocated(device), "peak": torch.cuda.max_memory_allocated(device),
                "reserved": torch.cuda.memory_reserved(device)}
    st = proc_memory.status()
    out = {"rss": st["VmRSS"], "peak": st["VmHWM"]}
    if _LIBC is not None:
        info = _LIBC.mallinfo2()
        out["malloc"] = int(info.uordblks + info.hblkhd)
        # Free bytes malloc keeps inside its arenas (every thread's): memory the process holds with
        # nothing live in it, unless glibc has returned those pages (``malloc_trim``).
        out["free kept"] = int(info.fordblks)
    return out


def reset_peak(device: torch.device) -> None:
    """Start a new peak (VmHWM is reset through ``/proc/self/clear_refs``)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    proc_memory.reset_peak()


# -- tensor census ------------------------------------------------------------------------------
def _storages(tensors: Iterable[Any]) -> Iterable[tuple[int, int]]:
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            local = getattr(t, "_local_tensor", None)  # FSDP2's DTensor: the shard this rank holds
            t = local if isinstance(local, torch.Tensor) else t
            st = t.untyped_storage()
            if st.nbytes():
                # On CPU, resident pages: a storage whose pages were handed back (a released ZeRO-3
                # unit, a lent master row) keeps its size but holds nothing.
                n = st.nbytes() if t.device.type != "cpu" else proc_memory.resident(st.data_ptr(), st.nbytes())
                yield st.data_ptr(), n


class SavedTensors:
    """Tensors autograd saved for backward (weak references: they die with the graph)."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref[torch.Tensor]] = []

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.refs.append(weakref.ref(t))
        return t

    def live(self) -> list[torch.Tensor]:
        alive = [t for t in (r() for r in self.refs) if t is not None]
        self.refs = [weakref.ref(t) for t in alive]
        return alive


def zeroshard_sources(engine: Any) -> dict[str, Callable[[], list[Any]]]:
    """Which tensors of a zeroshard engine belong to which category (read at each sample)."""
    from zeroshard.core.zero3.param_unit import UnitState

    opt = engine.optimizer
    units = getattr(opt, "units", [])

    def params() -> list[Any]:
        shard = [opt.shard.flat] if units and opt.shard.flat is not None else []
        persistent = [p.data for u in units if u.persistent for p in u.params]
        rest = [] if units else [p.data for p in engine.module.parameters()]
        return shard + persistent + rest

    def gathered() -> list[Any]:
        out: list[Any] = []
        for u in units:
            if u.state is UnitState.GATHERED:
                out += [p.data for p in u.params]
            if u._pending is not None:
                out.append(u._pending[0])
        return out

    def grads() -> list[Any]:
        return [opt.sync.acc] + [p.grad for p in engine.module.parameters() if p.grad is not None]

    def comm() -> list[Any]:
        sync, master = opt.sync, opt.master
        return (list(getattr(sync, "_buffers", {}).values()) + list(getattr(sync, "_free", []))
                + [t for pair in master._gather_buffers for t in pair])

    def state() -> list[Any]:
        return [v for st in opt.optimizer.state.values() for v in st.values()]

    return {"parameters": params, "gathered": gathered, "gradients": grads, "comm": comm,
            "master": lambda: [opt.master.flat], "optimizer": state}


def torch_sources(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Callable[[], list[Any]]]:
    """The same for a plain-torch system: parameters (FSDP2: the local shard, its unsharded
    parameters are not reachable), ``.grad`` (DDP: views of its buckets, which stay allocated
    inside the reducer when ``.grad`` is ``None``) and optimizer state."""
    return {"parameters": lambda: [p.data for p in model.parameters()],
            "gradients": lambda: [p.grad for p in model.parameters() if p.grad is not None],
            "optimizer": lambda: [v for st in optimizer.state.values() for v in st.values()]}


class Timeline:
    """Samples of category bytes and process bytes, as growth over the baseline."""

    def __init__(self, device: torch.device, sources: dict[str, Callable[[], list[Any]]], saved: SavedTensors,
                 base: dict[str, int]) -> None:
        self.device, self.sources, self.saved, self.base = device, sources, saved, base
        self.rows: list[dict[str, Any]] = []

    def sample(self, label: str) -> None:
        seen: set[int] = set()
        row: dict[str, Any] = {"at": label}
        for cat in CATEGORIES:
            tensors = self.saved.live() if cat == "activations" else self.sources.get(cat, list)()
            n = 0
            for ptr, nbytes in _storages(tensors):
                if ptr not in seen:
                    seen.add(ptr)
                    n += nbytes
            row[cat] = n
        row["tensors"] = sum(row[c] for c in CATEGORIES)
        for k, v in process_bytes(self.device).items():
            row[k] = v - self.base.get(k if k != "peak" else ("rss" if "rss" in self.base else "allocated"), 0)
        self.rows.append(row)


# -- the measured step --------------------------------------------------------------------------
def _hooks(model: torch.nn.Module, tl: Timeline) -> list[Any]:
    handles = []
    for name, m in model.named_modules():
        if next(m.parameters(recurse=False), None) is None:
            continue
        handles.append(m.register_forward_pre_hook(lambda _m, _a, n=name: tl.sample(f"fwd> {n}")))
        handles.append(m.register_forward_hook(lambda _m, _a, _o, n=name: tl.sample(f"fwd< {n}")))
    for name, p in model.named_parameters():
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(lambda _p, n=name: tl.sample(f"bwd {n}")))
    return handles


def worker(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """One rank: warm up, then sample one step. Returns the samples and this rank's peak."""
    from benchmarks.harness.spec import Job, Workload
    from benchmarks.harness.systems.base import deepspeed_config
    from benchmarks.harness.workload import batches, build_model

    device = torch.device("cuda", rank) if args["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    wl = Workload(micro_batch=args["micro_batch"], seq_len=args["seq_len"], grad_accum=args["grad_accum"])
    job = Job(args["system"], args["stage"], args["size"], device=args["device"], world_size=world,
              dtype=args["dtype"], workload=wl)
    data = batches(job, rank, args["warmup"] + 1, 256)
    reset_peak(device)
    base = process_bytes(device)
    model = build_model(job, device)
    saved = SavedTensors()
    if args["system"] in ("ddp", "fsdp2"):
        from benchmarks.harness.systems import ddp, fsdp2

        loop = (ddp if args["system"] == "ddp" else fsdp2).build(model, job, device)
        sources, module = torch_sources(model, loop.optimizer), model

        def step(micro: list[Any], tl: Timeline | None) -> None:
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                loop.train_step([(x.to(device), y.to(device)) for x, y in micro])
            _mark(tl, "after step")
    else:
        import zeroshard

        cfg = deepspeed_config(job)
        cfg["zero_optimization"].update(args["zero"])
        engine, *_ = zeroshard.initialize(model=model, config=cfg)
        sources, module = zeroshard_sources(engine), engine.module

        def step(micro: list[Any], tl: Timeline | None) -> None:
            for i, (x, y) in enumerate(micro):
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                    loss = engine(x.to(device), y.to(device))
                _mark(tl, f"after forward {i}")
                engine.backward(loss)
                _mark(tl, f"after backward {i}")
                engine.step()
            _mark(tl, "after step")

    times = []
    for micro in data[:-1]:
        t = time.perf_counter()
        step(micro, None)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    tl = Timeline(device, sources, saved, base)
    tl.sample("before step")
    handles = _hooks(module, tl)
    if args["snapshot"] and device.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    step(data[-1], tl)
    if args["snapshot"] and device.type == "cuda":
        torch.cuda.memory._dump_snapshot(f"{args['snapshot']}.rank{rank}")
        torch.cuda.memory._record_memory_history(enabled=None)
    for h in handles:
        h.remove()
    # Step time without the sampling: the warm-up steps after the first.
    step_s = statistics.median(times[1:]) if len(times) > 1 else float("nan")
    return {"rows": tl.rows, "peak": max(r["peak"] for r in tl.rows), "step_s": step_s}


def _mark(tl: Timeline | None, label: str) -> None:
    if tl is not None:
        tl.sample(label)


# -- report ---------------------------------------------------------------------------------------
def report(rows: list[dict[str, Any]], peaks: list[int], title: str) -> str:
    """Markdown: phase marks, the samples where RSS and each category peaked, per-rank peaks."""
    cols = [c for c in CATEGORIES if any(r[c] for r in rows)] + ["tensors"]
    proc = [k for k in ("rss", "peak", "malloc", "free kept", "allocated", "reserved") if k in rows[0]]
    keep: dict[int, str] = {i: "" for i, r in enumerate(rows) if not r["at"].startswith(("fwd", "bwd"))}
    for key in ["tensors", *proc, *cols]:
        i = max(range(len(rows)), key=lambda j: rows[j][key])
        keep[i] = (keep.get(i, "") + f" max {key}").strip()
    lines = [f"## {title}", "",
             "MiB, growth over the process before the model was built; rank 0's samples of one step.", "",
             "| at | " + " | ".join(cols + proc) + " | note |", "|---|" + "---:|" * (len(cols) + len(proc)) + "---|"]
    for i in sorted(keep):
        r = rows[i]
        vals = [f"{r[k] / MiB:.1f}" for k in cols + proc]
        lines.append(f"| {r['at']} | " + " | ".join(vals) + f" | {keep[i]} |")
    lines += ["", "Peak per rank (MiB): " + ", ".join(f"{p / MiB:.1f}" for p in peaks), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run the ranks, print (and write) the report."""
    from benchmarks.harness.spawned import run_on_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system", choices=("zeroshard", "ddp", "fsdp2"), default="zeroshard")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--size", default="25m")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3, help="steps before the sampled one (all but the first timed)")
    p.add_argument("--zero", default="{}", help="JSON merged into zero_optimization")
    p.add_argument("--snapshot", default="", help="CUDA: write torch.cuda.memory snapshots to PATH.rankN")
    p.add_argument("--out", default="", help="also write the report to this Markdown file")
    a = p.parse_args(argv)
    args = {**vars(a), "zero": json.loads(a.zero)}
    if a.system != "zeroshard":
        args["stage"] = {"ddp": 0, "fsdp2": 3}[a.system]
    result = run_on_ranks(_rank0_and_peaks, a.world_size, args)
    what = {"ddp": "torch DDP", "fsdp2": "torch FSDP2"}.get(
        a.system, f"zeroshard stage {a.stage} {a.zero if a.zero != '{}' else ''}")
    title = (f"{what}: GPT {a.size}, {a.dtype}, {a.world_size} ranks ({a.device}), micro batch "
             f"{a.micro_batch} x {a.seq_len} tokens x {a.grad_accum} accumulation")
    text = report(result["rows"], result["peaks"], title)
    text += f"Step time (rank 0, median of the warm-up steps after the first): {result['step_s']:.3f} s\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


def _rank0_and_peaks(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    out = worker(rank, world, args)
    peaks = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(peaks, torch.tensor([out["peak"]], dtype=torch.int64))
    return {"rows": out["rows"], "peaks": [int(p) for p in peaks], "step_s": out["step_s"]}


if __name__ == "__main__":
    sys.exit(main())
