"""The PNG chart: step time, model state and peak memory per stage and system (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.harness.derive import MiB
from benchmarks.harness.spec import SYSTEM_LABELS, SYSTEMS

COLORS = {"zeroshard": "#1b9e77", "zeroshard_reshard": "#66c2a5",
          "deepspeed": "#d95f02", "ddp": "#7570b3", "zero_redundancy": "#e7298a",
          "fsdp2": "#66a61e"}


def draw(rows: list[dict[str, Any]], path: Path, machine: str) -> str | None:
    """Draw the chart to ``path``; return why it was not drawn, or ``None``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]')"
    sizes = list(dict.fromkeys(r["size"] for r in rows if r["status"] == "ok"))
    if not sizes:
        return "no successful job"
    cuda = any(r["job"]["device"] == "cuda" for r in rows if r["status"] == "ok")
    mem_key, mem_label = (("peak_device_bytes", "peak device memory (MiB)") if cuda
                          else ("peak_rss", "peak RSS per rank (MiB)"))
    panels = [("step_s", "median step time (s)"), ("state_bytes", "model state per rank (MiB)"), (mem_key, mem_label)]
    height = 4.4 * len(sizes) + 1.0  # inches: rows of panels plus the title and legend band
    fig, axes = plt.subplots(len(sizes), 3, figsize=(17, height), squeeze=False)
    for i, size in enumerate(sizes):
        sized = [r for r in rows if r["size"] == size and r["status"] == "ok"]
        for j, (key, label) in enumerate(panels):
            _panel(axes[i][j], sized, key, f"{size} ({sized[0]['numel'] / 1e6:.0f}M params): {label}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[s]) for s in SYSTEMS]
    fig.suptitle(f"zeroshard vs peers, lower is better ({machine})", y=1 - 0.15 / height, va="top", fontsize=13)
    fig.legend(handles, [SYSTEM_LABELS[s] for s in SYSTEMS], loc="upper center", ncol=len(SYSTEMS), fontsize=11,
               frameon=False, bbox_to_anchor=(0.5, 1 - 0.45 / height))
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.95 / height))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _value(r: dict[str, Any], key: str) -> float:
    v = r[key]
    if isinstance(v, list):
        v = max(v)
    return float(v) if key == "step_s" else float(v) / MiB


def _panel(ax: Any, rows: list[dict[str, Any]], key: str, title: str) -> None:
    variants = sorted(dict.fromkeys(r["variant"] for r in rows))
    per_variant = {v: [r for r in rows if r["variant"] == v] for v in variants}
    width = 0.8 / max(len(rs) for rs in per_variant.values())
    for x, v in enumerate(variants):
        rs = sorted(per_variant[v], key=lambda r: SYSTEMS.index(r["system"]))
        for k, r in enumerate(rs):
            pos = x - 0.4 + width * (k + 0.5)
            val = _value(r, key)
            ax.bar(pos, val, width * 0.92, color=COLORS[r["system"]])
            ax.text(pos, val, f"{val:.3g}" if key == "step_s" else f"{val:,.0f}", ha="center", va="bottom",
                    fontsize=7.5, rotation=90 if len(rs) > 3 else 0)
            if key == "state_bytes":
                f = r["formula_bytes"] / MiB
                ax.plot([pos - width / 2, pos + width / 2], [f, f], color="black", lw=1.5)
        refs = [r["step_s"] / r["vs_ddp"] for r in rs if key == "step_s" and r.get("vs_ddp")]
        if refs:  # DDP measured alongside this group (paired) or alone: where 1.00x DDP lies
            ref = sorted(refs)[len(refs) // 2]
            ax.plot([x - 0.42, x + 0.42], [ref, ref], color=COLORS["ddp"], lw=1.2, ls="--")
    ax.set_xticks(range(len(variants)), [f"stage {v}" for v in variants])
    note = {"state_bytes": " — black: ZeRO formula", "step_s": " — dashed: DDP in the same run"}.get(key, "")
    ax.set_title(title + note, fontsize=10)
    ax.margins(y=0.18)
    ax.grid(axis="y", alpha=0.3)
