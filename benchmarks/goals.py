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
