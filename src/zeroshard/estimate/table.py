"""Plain-text rendering of an :class:`~zeroshard.estimate.planner.Estimate` and a plan."""

from __future__ import annotations

from collections.abc import Sequence

from zeroshard.estimate.model_spec import format_count
from zeroshard.estimate.planner import Estimate, Plan

__all__ = ["format_bytes", "render_estimate", "render_plan"]

_HEADERS = ("stage", "offload", "model states", "buffers", "GPU total", "GPU, act. ckpt", "CPU per node",
            "NVMe per node")


def format_bytes(n: int | float | None) -> str:
    """Bytes as GiB with two decimals (``?`` when unknown)."""
    return "?" if n is None else f"{n / 2**30:.2f} GiB"


def _grid(rows: Sequence[tuple[str, ...]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return [line(rows[0]), rule, *(line(r) for r in rows[1:])]


def render_estimate(est: Estimate) -> str:
    """The header lines, the table, and what its columns mean."""
    spec, hw, tr = est.spec, est.hardware, est.training
    largest = f"largest layer {format_count(spec.largest_layer_params)}"
    if spec.largest_layer_name:
        largest += f" ({spec.largest_layer_name})"
    if spec.largest_assumed:
        largest += " (assumed: 5% of the parameters; --largest-layer to set)"
    nodes = f"{hw.nodes} node{'s' if hw.nodes > 1 else ''}"
    accum = f", {tr.grad_accum_dtype} gradient accumulation" if tr.dtype != "fp32" else ""
    lines = [
        f"model: {spec.description}: {format_count(spec.total_params)} parameters, {largest}",
        f"set-up: {nodes} x {hw.gpus_per_node} GPU{'s' if hw.gpus_per_node > 1 else ''} "
        f"({hw.world} rank{'s' if hw.world > 1 else ''}), {tr.dtype} compute{accum}, Adam",
    ]
    act = est.activations
    if tr.activation_bytes is not None:
        lines.append(f"activations per GPU: {format_bytes(tr.activation_bytes)} (given with --activation-bytes)")
    elif act is not None:
        lines.append(f"activations per GPU (micro batch {tr.micro_batch} x {tr.seq_len} tokens, {tr.attention} "
                     f"attention): {format_bytes(act.total)}; with activation checkpointing "
                     f"{format_bytes(act.checkpointed)}")
        shape = spec.transformer
        if shape is not None and not shape.exact:
            lines[-1] += f" (approximate: {shape.family} read as a generic decoder)"
    else:
        lines.append("activations: unknown for this model (they need a Hugging Face transformer config, or "
                     "--activation-bytes); GPU totals below are without them")
    cells = [_HEADERS]
    for r in est.rows:
        cells.append((str(r.stage), r.offload, format_bytes(r.model_states), format_bytes(r.buffers),
                      format_bytes(r.gpu_total(False)), format_bytes(r.gpu_total(True)), format_bytes(r.cpu_per_node),
                      format_bytes(r.nvme_per_node) if r.nvme_per_node else "-"))
    lines += ["", *_grid(cells, right={2, 3, 4, 5, 6, 7}), ""]
    lines += [
        "model states: parameters, gradients, fp32 master weights, Adam's moments that stay on the GPU "
        "(engine.memory_usage()).",
        *(f"{r.offload}: offload_optimizer.ratio, the first int((1 - ratio) x n) of a GPU's n optimizer sub-groups "
          f"({format_count(r.choice.sub_group_size or 10**9)} elements each at most) keep their masters and Adam's "
          "moments on the GPU." for r in est.rows if r.choice.partial),
        "buffers: communication buckets at DeepSpeed's default sizes; at stage 3 also the gathered parameters.",
        "GPU total: model states + buffers + activations; add ~1 GiB for the CUDA context.",
        "CPU per node: the larger of building the model (every process builds it on the CPU, stage 3 under "
        "zero.Init; x1.5 as DeepSpeed) and the offloaded state of the node's processes (masters, Adam's "
        "moments, gradient shards, swap buffers).",
        "NVMe per node: swap files under nvme_path (masters and Adam's moments; with params->nvme the parameter "
        "shards); host swap buffers at DeepSpeed's default buffer_count, sub_group_size left unset (zeroshard "
        "then sizes sub-groups so that the buffers hold a quarter of the in-memory optimizer state).",
    ]
    return "\n".join(lines)


def render_plan(plan: Plan, path: str | None) -> str:
    """What the planner chose, and where the config went."""
    r = plan.row
    ckpt = " with activation checkpointing" if plan.checkpointing else ""
    offload = "" if r.offload == "none" else f", offload {r.offload}"
    buckets = f"; reduce buckets of {format_count(r.buckets.reduce_bucket_size)} elements" if r.buckets else ""
    nvme = f", {format_bytes(r.nvme_per_node)} NVMe per node" if r.nvme_per_node else ""
    lines = [f"chosen: ZeRO stage {r.stage}{offload}{ckpt}, {format_bytes(r.gpu_total(plan.checkpointing))} per GPU, "
             f"{format_bytes(r.cpu_per_node)} CPU per node{nvme}{buckets}"]
    lines += [f"note: {n}" for n in plan.notes]
    if path:
        lines.append(f"wrote {path}")
    return "\n".join(lines)
