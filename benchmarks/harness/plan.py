"""Which jobs one invocation runs (parent side, no torch import).

Ordinary jobs: one per (system, stage variant, size), each in fresh processes, for start-up costs,
memory and (without ``--paired``) step times. Paired jobs (``--paired``): one per (stage, size),
the systems of that stage side by side, for step times that see the same machine load.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from typing import Any

from benchmarks.harness.spec import FIXED_STAGE, LIBRARIES, SIZES, SYSTEM_LABELS, SYSTEMS, Job, Workload, paired_members

# (warm-up, measured) steps per size on CPU. A 120M step costs ~5x a 25M step. With --paired, the
# ordinary jobs only measure start-up and memory (a short run) and the paired jobs measure time.
STEPS = {"quick": {"25m": (2, 4)}, "full": {"25m": (2, 10), "120m": (2, 6)}}
SHORT = (1, 2)
PAIRED_ROUNDS = {"25m": (2, 8), "120m": (1, 4)}
GPU_STEPS = (3, 10)


def placeholder(job: Job, status: str, reason: str) -> dict[str, Any]:
    """A result row for a job that did not run (``missing``, ``skipped``)."""
    return {"key": job.key, "system": job.system, "stage": job.stage, "variant": job.variant, "size": job.size,
            "job": json.loads(job.to_json()), "status": status, "reason": reason}


def _check(names: list[str], known: Any, what: str) -> None:
    for name in names:
        if name not in known:
            raise SystemExit(f"unknown {what} {name!r}; choose from {', '.join(known)}")


def _workload(args: argparse.Namespace, steps: tuple[int, int]) -> Workload:
    cuda = args.device == "cuda"
    return Workload(micro_batch=args.micro_batch or (8 if cuda else 4), seq_len=args.seq_len or (1024 if cuda else 64),
                    grad_accum=args.grad_accum, warmup_steps=args.warmup if args.warmup is not None else steps[0],
                    measure_steps=args.steps or steps[1])


def sizes_of(args: argparse.Namespace) -> list[str]:
    """The model sizes this invocation covers."""
    sizes = args.sizes.split(",") if args.sizes else list(STEPS["quick" if args.quick else "full"])
    _check(sizes, SIZES, "size")
    return sizes


def plan(args: argparse.Namespace) -> tuple[list[Job], list[Job], list[dict[str, Any]]]:
    """(ordinary jobs, paired jobs, result rows for systems whose package is missing)."""
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    _check(systems, SYSTEMS, "system")
    stages = [int(s) for s in args.stages.split(",")]
    cuda = args.device == "cuda"
    world = args.world_size or (1 if cuda else 2)
    dtype = args.dtype or ("bf16" if cuda else "fp32")
    missing_libs = {s for s in systems if s in LIBRARIES and importlib.util.find_spec(LIBRARIES[s][0]) is None}
    jobs: list[Job] = []
    paired: list[Job] = []
    missing: list[dict[str, Any]] = []
    for size in sizes_of(args):
        steps = GPU_STEPS if cuda else STEPS["quick" if args.quick else "full"].get(size, (2, 6))
        wl = _workload(args, SHORT if args.paired else steps)
        for system, stage, offload in ordered_variants(systems, stages, args.offload):
            job = Job(system, stage, size, device=args.device, world_size=world, offload=offload, dtype=dtype,
                      workload=wl)
            if system in missing_libs:
                lib = LIBRARIES[system]
                missing.append(placeholder(job, "missing", f"{SYSTEM_LABELS[system]} is not installed: {lib[1]}"))
            else:
                jobs.append(job)
        if args.paired:
            pwl = _workload(args, PAIRED_ROUNDS.get(size, GPU_STEPS if cuda else (1, 4)))
            present = [s for s in systems if s not in missing_libs]
            for stage in stages:
                members = paired_members(stage, present)
                if len(members) > 1:
                    paired.append(Job(members[0][0], stage, size, device=args.device, world_size=world,
                                      dtype=dtype, workload=pwl, members=members))
    return jobs, paired, missing


def ordered_variants(systems: list[str], stages: list[int], offload: bool) -> list[tuple[str, int, bool]]:
    """Interleave systems stage by stage, so drift on a busy machine spreads over all of them."""
    out: list[tuple[str, int, bool]] = []
    for stage in sorted(set(stages) | set(FIXED_STAGE.values())):
        for system in systems:
            fixed = FIXED_STAGE.get(system)
            if (fixed is None and stage in stages) or fixed == stage:
                out.append((system, stage, False))
    if offload:
        out += [(s, st, True) for st in (2, 3) if st in stages for s in systems if s not in FIXED_STAGE]
    return out


def attach_paired(results: list[dict[str, Any]], paired: list[dict[str, Any]]) -> None:
    """Give every ordinary result the step time and ratios its system measured in a paired job.

    A system's own stage's paired job wins (DDP, which runs in every paired job, takes stage 0's)."""
    for pr in paired:
        if pr["status"] != "ok":
            continue
        for name, m in pr["members"].items():
            system, stage = name.split(":")
            row = next((r for r in results if r["size"] == pr["size"] and r["system"] == system
                        and r["variant"] == stage and r["status"] == "ok"), None)
            if row is None or m["status"] != "ok" or ("paired" in row and pr["stage"] != int(stage)):
                continue
            vs = m["vs"]
            row["paired"] = {
                "job": pr["key"], "step_s": m["step_s"], "step_s_min": min(m["step_s_rounds"]),
                "rounds": len(m["step_s_rounds"]), "final_loss": m["losses"][-1], "losses": m["losses"],
                "vs_deepspeed": vs.get(f"deepspeed:{stage}"), "vs_ddp": vs.get("ddp:0"),
                "vs_fsdp2": vs.get("fsdp2:3"), "phases_s": m.get("phases_s"),
                "vs_iqr": {k.split(":")[0]: v for k, v in m.get("vs_iqr", {}).items()},
            }
