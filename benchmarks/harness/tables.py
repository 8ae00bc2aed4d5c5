"""The markdown report (``RESULTS.md``): machine and versions, tables per size, goals, notes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.harness.derive import PEAK_BF16_FLOPS, MiB
from benchmarks.harness.goals import check
from benchmarks.harness.machine import allocator_text
from benchmarks.harness.spec import SIZES, SYSTEM_LABELS, SYSTEMS


def rel_path(path: Path, base: Path) -> str:
    """``path`` relative to ``base`` when it is below it (for links in the markdown)."""
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path)


def _f(v: float | None, fmt: str, none: str = "–") -> str:
    return none if v is None else format(v, fmt)


def _order(r: dict[str, Any]) -> tuple[int, str, int]:
    return (list(SIZES).index(r["size"]), r["variant"], SYSTEMS.index(r["system"]))


def _speed_table(rows: list[dict[str, Any]], cuda: bool) -> list[str]:
    paired = any(r.get("timing") == "paired" for r in rows)
    cols = ["stage", "system", "step (s)", "min (s)"] + (["alone (s)"] if paired else [])
    cols += ["tokens/s", "× DeepSpeed", "× DDP", "× FSDP2"]
    cols += ["MFU"] if cuda else ["CPU s/step", "fwd / bwd / opt (s)"]
    cols += ["final loss"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        name = SYSTEM_LABELS[r["system"]]
        if r["status"] != "ok":
            lines.append("| " + " | ".join([r["variant"], name, f"*{r['status']}*"] + [""] * (len(cols) - 3)) + " |")
            continue
        cells = [r["variant"], name, f"{r['step_s']:.3f}", f"{r['step_s_min']:.3f}"]
        if paired:
            cells.append(_f(r.get("alone_step_s"), ".3f"))
        cells += [f"{r['tokens_per_s']:,.0f}", _f(r.get("vs_deepspeed"), ".2f"), _f(r.get("vs_ddp"), ".2f"),
                  _f(r.get("vs_fsdp2"), ".2f")]
        if cuda:
            cells.append(_f(r.get("mfu"), ".1%"))
        else:
            ph = r.get("phases_s") or {}
            cells += [f"{r['step_cpu_s']:.2f}",
                      " / ".join(f"{ph[k]:.2f}" for k in ("forward", "backward", "optimizer")) if ph else "–"]
        cells.append(f"{r['final_loss']:.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _memory_table(rows: list[dict[str, Any]], cuda: bool) -> list[str]:
    dev = " peak device MiB |" if cuda else ""
    head = ("| stage | system | model state MiB/rank | ZeRO formula MiB | vs formula | peak RSS MiB/rank |" + dev
            + " import (s) | initialize (s) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if r["status"] != "ok":
            continue
        cells = [r["variant"], SYSTEM_LABELS[r["system"]], f"{r['state_bytes'] / MiB:,.0f}",
                 f"{r['formula_bytes'] / MiB:,.0f}", f"{r['vs_formula']:+.1%}", f"{max(r['peak_rss']) / MiB:,.0f}"]
        if cuda:
            cells.append(f"{r['peak_device_bytes'] / MiB:,.0f}")
        cells += [f"{r['import_system_s']:.3f}", f"{r['initialize_s']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any], chart: str, chart_note: str | None) -> str:
    """The full RESULTS.md text."""
    cuda = meta["device"] == "cuda"
    rows = sorted(rows, key=_order)
    ok = [r for r in rows if r["status"] == "ok"]
    hw = ", ".join(meta["gpus"]) if cuda else f"{meta['cpu']}, {meta['cpu_cores']} cores"
    out = [
        f"# Benchmark results ({meta['device'].upper()})", "",
        f"- Machine: {hw}, {meta['memory_gib']} GiB RAM, {meta['os']}, Python {meta['python']}",
        f"- torch {meta['torch']}, DeepSpeed {meta['deepspeed']}, zeroshard {meta['zeroshard']} "
        f"(git {meta.get('zeroshard_git', 'unknown')})" + _imported_from(rows),
        f"- Date: {meta['date']}; the whole run took {meta['elapsed_s'] / 60:.1f} min",
        _load_line(rows, meta),
        f"- Command: `{meta['command']}`",
        "- C allocator: " + allocator_text(meta.get("allocator", {}))
        + (" for every system's processes (README, \"Memory\")" if meta.get("allocator") else ""),
    ]
    if any(r.get("timing") == "paired" for r in ok):
        rounds = max(r["paired"]["rounds"] for r in ok if r.get("paired"))
        out.append("- Step times are **paired**: the systems of each stage (and DDP) train side by side in the "
                   f"same rank processes, one step each in turn for {rounds} measured rounds, so they see the same "
                   "machine load; ratios are medians of per-round ratios (the goals table also gives their "
                   "quartiles over the rounds, to show how much one round differs from the next). **alone** "
                   "is the median step of each system's own short run (fresh processes, the only model in "
                   "memory), which also gives CPU s/step, start-up and memory. The members share one heap: "
                   "ZeRO-3's CPU `malloc_trim` (README, \"Memory\") returns the other members' free heap "
                   "too, so they re-fault it: in a paired stage-3 job every member runs slower than with "
                   "`ZEROSHARD_MALLOC_TRIM=0` (`benchmarks/results/stage3_alone.md` compares ZeRO-3 and "
                   "FSDP2 in fresh processes instead).")
    if ok:
        job = ok[0]["job"]
        wl = job["workload"]
        out.append(f"- Workload: GPT (examples/gpt.py), {job['world_size']} rank(s) "
                   f"({'NCCL' if cuda else 'gloo'}), {job['dtype']}, global batch {ok[0]['tokens_per_step']} "
                   f"tokens ({job['world_size']} × {wl['micro_batch']} × {wl['seq_len']} tokens × "
                   f"{wl['grad_accum']} accumulation), AdamW (torch fused) lr {wl['lr']}, clipping {wl['clip']}; "
                   f"median of measured steps after warm-up (step = slowest rank)")
    out += ["", f"![step time and memory per stage and system]({chart})" if chart_note is None
            else f"_Chart not drawn: {chart_note}_", ""]
    for size in dict.fromkeys(r["size"] for r in rows):
        sized = [r for r in rows if r["size"] == size]
        numel = next((r["numel"] for r in sized if r["status"] == "ok"), None)
        extra = ", ".join(f"{k}={v}" for k, v in vars_size(size).items())
        out += [f"## {size}: {numel / 1e6:.1f}M parameters ({extra})" if numel else f"## {size}", "",
                *(_speed_table(sized, cuda)), "", *(_memory_table(sized, cuda)), ""]
        for r in sized:
            if r["status"] != "ok":
                out.append(f"- {SYSTEM_LABELS[r['system']]} stage {r['variant']}: **{r['status']}**: "
                           f"{r.get('reason', '')}")
        out.append("")
    out += ["## Performance goals (this run)", "", "| goal | measured | met |", "|---|---|---|"]
    for goal, text, met in check(rows):
        out.append(f"| {goal} | {text} | {'n/a' if met is None else ('yes' if met else '**no**')} |")
    out += ["", NOTES.format(peak=PEAK_BF16_FLOPS / 1e12)]
    return "\n".join(out) + "\n"


def _imported_from(rows: list[dict[str, Any]]) -> str:
    where = sorted({r["zeroshard_from"] for r in rows if r.get("zeroshard_from")})
    return f", imported from {', '.join(where)}" if where else ""


def _load_line(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    loads = [x for r in rows for x in r.get("load_average", [])]
    if not loads:
        return "- Machine load: not recorded"
    cores = meta["cpu_cores"]
    busy = max(loads) > cores + 1.0  # the benchmark itself keeps about `cores` runnable
    note = (f" — **other processes competed for the {cores} cores during this run, so wall times are noisy; "
            "CPU s/step is less affected**") if busy else ""
    return f"- Machine load (1-minute load average, before/after each job): {min(loads):.1f}–{max(loads):.1f}{note}"


def vars_size(size: str) -> dict[str, int]:
    """The GPT shape of a size, for headings."""
    s = SIZES[size]
    return {"n_layer": s.n_layer, "n_embd": s.n_embd, "n_head": s.n_head, "vocab": s.vocab_size}


NOTES = """## How to read this

- **step (s)**: median wall time of a measured optimizer step (forward, backward, gradient
  communication, clipping, AdamW, parameter all-gather), the slowest rank's time per step; **min**:
  the fastest measured step; **CPU s/step**: CPU time of the busiest rank process (all its threads)
  per step, which other load on the machine inflates less than wall time; **fwd / bwd / opt**: median
  wall time of forward, backward (including the gradient communication backward hooks start and
  wait for) and everything after backward (reduction, clipping, AdamW, parameter all-gather).
  **× DeepSpeed**: step time ÷ DeepSpeed's at the same stage; **× DDP**: ÷ torch DDP's;
  **× FSDP2**: ÷ FSDP2's (stage 3 rows). Below 1 is faster.
- **Same work everywhere**: same initial weights (seeded), same byte-level batches of
  `examples/data/sonnets.txt`, same global batch, AdamW hyperparameters and clipping 1.0; every system
  uses torch's fused AdamW kernel (DeepSpeed through `"torch_adam": true, "fused": true`). zeroshard and
  DeepSpeed get the same DeepSpeed-schema config (`overlap_comm: true`, 25 MiB-of-fp32 buckets, like DDP's
  default `bucket_cap_mb=25`). DDP uses `gradient_as_bucket_view=True`; ZeroRedundancyOptimizer wraps the
  same DDP; FSDP2 applies `fully_shard` to every block and the root. Matching final losses show the
  systems computed the same training.
- **model state**: bytes of parameters, gradients, master weights and optimizer state held per rank
  after backward and before the optimizer step. zeroshard: `engine.memory_usage()` (persistent
  entries); others: every distinct tensor storage reachable from the model and optimizer objects
  (tensors held only inside C++ are not seen). **ZeRO formula**: `P·Ψ + P·Ψ + K·Ψ` with
  parameters sharded from stage 3, gradients from stage 2 and optimizer state from stage 1
  (÷ world size); `P` = 4 (fp32) or 2 (bf16); `K` = 8 for Adam's two fp32 moments, plus 4 for an
  fp32 master copy in 16-bit training. In fp32 training the parameters are the master weights.
- **peak RSS**: `ru_maxrss` of each rank process (the largest rank), imports included.
- **import**: seconds for `import <system>` after `import torch` in a fresh process.
  **initialize**: seconds for `initialize` / wrapping the model and building the optimizer, in a fresh
  process after `import torch._dynamo`: torch's `Optimizer.__init__` imports `torch._dynamo` on first
  use (2–3 s on 2 CPU cores), which every system pays once; the JSON has it as `import_torch_dynamo_s`.
- **MFU** (CUDA): `6 · parameters · tokens/s ÷ ({peak:.0f} TFLOP/s × GPUs)`, the dense bf16 peak of an
  H100/H200 SXM; attention FLOPs are not counted.
- Raw per-step times, per-rank memory, losses and start-up phases are in the JSON next to the chart.
"""
