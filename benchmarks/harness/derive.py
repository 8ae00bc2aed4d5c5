"""Numbers derived from raw job results: ratios between systems, the ZeRO formula, MFU."""

from __future__ import annotations

from typing import Any

from benchmarks.harness.spec import zero_formula_bytes

PEAK_BF16_FLOPS = 989e12
"""Dense bf16 peak of one H100/H200 SXM (989 TFLOP/s), the MFU denominator on CUDA."""

MiB = 2**20


def _find(results: list[dict[str, Any]], size: str, system: str, variant: str | None = None) -> dict[str, Any] | None:
    for r in results:
        if r["size"] == size and r["system"] == system and r["status"] == "ok" \
                and (variant is None or r["variant"] == variant):
            return r
    return None


def derive(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add ``vs_deepspeed``, ``vs_ddp``, ``vs_fsdp2`` (step-time ratios; ``*_cpu``: CPU-time ratios), ``formula_bytes``,
    ``vs_formula`` (relative difference) and, on CUDA, ``mfu`` to every successful row."""
    out = []
    for r in results:
        r = dict(r)
        if r["status"] == "ok":
            job = r["job"]
            ds = _find(results, r["size"], "deepspeed", r["variant"])
            ddp = _find(results, r["size"], "ddp")
            fsdp = _find(results, r["size"], "fsdp2") if r["stage"] == 3 else None
            peers = {"deepspeed": ds if r["system"] != "deepspeed" else None, "ddp": ddp,
                     "fsdp2": fsdp if r["system"] != "fsdp2" else None}
            for name, peer in peers.items():
                r[f"vs_{name}"] = r["step_s"] / peer["step_s"] if peer else None
                cpu, peer_cpu = r.get("step_cpu_s"), (peer or {}).get("step_cpu_s")
                r[f"vs_{name}_cpu"] = cpu / peer_cpu if cpu and peer_cpu else None
            _use_paired(r)
            param_bytes = 2 if job["dtype"] == "bf16" else 4
            r["formula_bytes"] = zero_formula_bytes(r["numel"], r["stage"], job["world_size"], param_bytes)
            r["vs_formula"] = r["state_bytes"] / r["formula_bytes"] - 1.0 if r["state_bytes"] else None
            if job["device"] == "cuda":
                r["mfu"] = 6 * r["numel"] * r["tokens_per_s"] / (job["world_size"] * PEAK_BF16_FLOPS)
        out.append(r)
    return out


def _use_paired(r: dict[str, Any]) -> None:
    """Take step time, ratios and final loss from the paired job when there is one; the ordinary
    job's own numbers stay under ``alone_*``."""
    pr = r.get("paired")
    if not pr:
        r["timing"] = "alone"
        return
    keys = ("step_s", "step_s_min", "tokens_per_s", "final_loss", "vs_deepspeed", "vs_ddp", "vs_fsdp2", "phases_s")
    if r.get("timing") == "paired":  # re-rendering derived rows: start again from the ordinary job's numbers
        for key in keys:
            r[key] = r[f"alone_{key}"]
    r["timing"] = "paired"
    for key in keys:
        r[f"alone_{key}"] = r.get(key)
    if pr.get("phases_s"):
        r["phases_s"] = pr["phases_s"]
    r.update(step_s=pr["step_s"], step_s_min=pr["step_s_min"], tokens_per_s=r["tokens_per_step"] / pr["step_s"],
             final_loss=pr["final_loss"], vs_deepspeed=pr["vs_deepspeed"], vs_fsdp2=pr["vs_fsdp2"],
             vs_ddp=1.0 if r["system"] == "ddp" else pr["vs_ddp"])
    for name in ("deepspeed", "ddp", "fsdp2"):
        r[f"vs_{name}_cpu"] = None  # the short ordinary job's CPU time is not comparable
        r[f"vs_{name}_iqr"] = pr.get("vs_iqr", {}).get(name)
