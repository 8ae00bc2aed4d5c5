"""The issue's performance goals, checked against one benchmark run."""

from __future__ import annotations

from typing import Any

Goal = tuple[str, str, bool | None]
"""(goal, what was measured, met? — None when it could not be measured)."""


def _rows(results: list[dict[str, Any]], system: str) -> list[dict[str, Any]]:
    return [r for r in results if r["system"] == system and r["status"] == "ok"]


def _cpu(ratio: float | None) -> str:
    return f" (CPU time {ratio:.2f}x)" if ratio is not None else ""


def _iqr(q: Any) -> str:
    """The quartiles of the paired rounds' ratios, when measured."""
    return f" (rounds {q[0]:.2f}-{q[1]:.2f})" if q else ""


def _ratio_goal(name: str, rows: list[dict[str, Any]], key: str, limit: float) -> Goal:
    vals = [(r, float(r[key])) for r in rows if r.get(key) is not None]
    if not vals:
        return name, "not measured", None
    text = ", ".join(f"{r['size']} s{r['variant']}: {v:.2f}x" + _iqr(r.get(f"{key}_iqr")) + _cpu(r.get(f"{key}_cpu"))
                     for r, v in vals)
    return name, text, all(v <= limit for _, v in vals)


def check(results: list[dict[str, Any]]) -> list[Goal]:
    """Evaluate every goal that this run measured."""
    zs = [r for r in _rows(results, "zeroshard") if "offload" not in r["variant"]]
    goals = [
        _ratio_goal("each zeroshard stage <= 0.9x DeepSpeed's step time", zs, "vs_deepspeed", 0.9),
        _ratio_goal("stages 1 and 2 <= 1.05x DDP", [r for r in zs if r["stage"] in (1, 2)], "vs_ddp", 1.05),
        _ratio_goal("stage 3 <= 1.2x DDP", [r for r in zs if r["stage"] == 3], "vs_ddp", 1.2),
        _ratio_goal("stage 3 no slower than FSDP2", [r for r in zs if r["stage"] == 3], "vs_fsdp2", 1.0),
    ]
    mem = [(r, r["vs_formula"]) for r in zs]
    goals.append(("model-state bytes per rank within 5% of the ZeRO formula",
                  ", ".join(f"{r['size']} s{r['variant']}: {v:+.1%}" for r, v in mem) or "not measured",
                  all(abs(v) <= 0.05 for _, v in mem) if mem else None))
    goals += _memory_goals(results, zs)
    imp = [r["import_system_s"] for r in zs]
    goals.append(("`import zeroshard` adds <= 0.1 s to `import torch`",
                  f"max {max(imp):.3f} s" if imp else "not measured", max(imp) <= 0.1 if imp else None))
    init = [(r, r["initialize_s"]) for r in zs]
    goals.append(("first `initialize` < 2 s (after torch's own lazy imports, see notes)",
                  ", ".join(f"{r['size']} s{r['variant']}: {v:.2f} s" for r, v in init) or "not measured",
                  all(v < 2.0 for _, v in init) if init else None))
    comp = [r for r in zs if r["compiled"].get("jit_extensions") or r["compiled"].get("compiled_frames")]
    goals.append(("`initialize` and training never compile anything",
                  "no JIT extension loaded, no torch.compile frame" if zs and not comp else
                  ", ".join(r["key"] for r in comp) or "not measured", (not comp) if zs else None))
    return goals


def _peak(r: dict[str, Any]) -> float:
    return max(r["peak_rss"]) / 2**20


def _memory_goals(results: list[dict[str, Any]], zs: list[dict[str, Any]]) -> list[Goal]:
    """Peak RSS per rank (the largest rank) against DDP and FSDP2 of the same size (issue #9)."""
    def peer(size: str, system: str) -> dict[str, Any] | None:
        return next((r for r in _rows(results, system) if r["size"] == size), None)

    reshard = _rows(results, "zeroshard_reshard")
    default_vs, equal_vs, budget = [], [], []
    for r in zs + reshard:
        ddp, fsdp = peer(r["size"], "ddp"), peer(r["size"], "fsdp2")
        label = f"{r['size']} s{r['variant']}" + (" (as FSDP2)" if r["system"] == "zeroshard_reshard" else "")
        if fsdp is not None and r["stage"] == 3:
            ok = _peak(r) <= _peak(fsdp) and (r["system"] == "zeroshard" or (r.get("vs_fsdp2") or 9) <= 1.0)
            text = f"{label}: {_peak(r):,.0f} vs {_peak(fsdp):,.0f} MiB" + (
                f", step {r['vs_fsdp2']:.2f}x" if r["system"] == "zeroshard_reshard" and r.get("vs_fsdp2") else "")
            (default_vs if r["system"] == "zeroshard" else equal_vs).append((text, ok))
        if ddp is not None and r.get("state_bytes") and ddp.get("state_bytes"):
            target = _peak(ddp) - (ddp["state_bytes"] - r["state_bytes"]) / 2**20
            budget.append((f"{label}: {_peak(r):,.0f} MiB vs {target:,.0f} ({_peak(r) / target - 1:+.0%})",
                           _peak(r) <= 1.1 * target))

    def goal(name: str, items: list[tuple[str, bool]]) -> Goal:
        return name, ", ".join(t for t, _ in items) or "not measured", all(ok for _, ok in items) if items else None

    return [goal("stage 3 peak RSS <= FSDP2's, both at their defaults", default_vs),
            goal("stage 3 at FSDP2's setting (one block live): peak RSS <= FSDP2's and faster", equal_vs),
            goal("each stage's peak RSS within 10% of DDP's peak minus the model state it shards away", budget)]
