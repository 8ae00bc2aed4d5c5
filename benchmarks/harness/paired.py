"""Paired measurement: several systems train side by side in the same ranks, one step each in turn.

On a machine whose other load comes and goes (a shared 2-core box), two systems measured minutes
apart see different machines. Here every round runs one step of each member, rotating who goes
first, so consecutive steps of different systems see the same load; the ratio of two members' step
times is taken round by round and its median reported. Each member has its own model (same seed)
and optimizer; memory and start-up are measured by the ordinary, one-system jobs.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.harness.spec import SIZES, Job


def run_paired(job: Job, rank: int, device: Any, result: dict[str, Any]) -> None:
    """Worker side: build every member, run the rounds, record per-member step times and losses."""
    from benchmarks.harness.systems import get_system
    from benchmarks.harness.systems.base import NotAvailable
    from benchmarks.harness.workload import batches, build_model

    members: dict[str, dict[str, Any]] = {}
    trainers: dict[str, Any] = {}
    for system, stage in job.members:
        name = f"{system}:{stage}"
        mjob = job.member(system, stage)
        try:
            trainers[name] = get_system(system).build(build_model(mjob, device), mjob, device)
            members[name] = {"status": "ok", "step_s": [], "losses": [], "phases_s": []}
        except NotAvailable as exc:
            members[name] = {"status": "not available", "reason": str(exc)}
        except Exception as exc:  # a peer that cannot run here must not stop the others
            members[name] = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:600]}
    result["members"] = members
    steps = job.workload.warmup_steps + job.workload.measure_steps
    data = [[(x.to(device), y.to(device)) for x, y in step]
            for step in batches(job, rank, steps, SIZES[job.size].vocab_size)]
    names = list(trainers)
    for i, micro in enumerate(data):
        for name in names[i % len(names):] + names[: i % len(names)]:
            t = time.perf_counter()
            loss, _ = trainers[name].train_step(micro)
            if device.type == "cuda":
                import torch

                torch.cuda.synchronize(device)
            members[name]["step_s"].append(time.perf_counter() - t)
            members[name]["losses"].append(loss)
            members[name]["phases_s"].append(dict(trainers[name].phases.seconds))


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    q1, _q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def merge_paired(job: Job, ranks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Parent side: per member, the median step time and, against every other member, the median
    over measured rounds of the per-round step-time ratio (a round's step = its slowest rank)."""
    warm = job.workload.warmup_steps
    first = ranks[0]["members"]
    ok = [n for n, m in first.items() if m["status"] == "ok"]
    steps = {n: [max(r["members"][n]["step_s"][i] for r in ranks) for i in range(len(first[n]["step_s"]))]
             for n in ok}
    out: dict[str, dict[str, Any]] = {}
    for name, m in first.items():
        if m["status"] != "ok":
            out[name] = {"status": m["status"], "reason": m.get("reason", "")}
            continue
        mine = steps[name][warm:]
        out[name] = {
            "status": "ok", "step_s": statistics.median(mine), "step_s_rounds": mine,
            "losses": [statistics.fmean(r["members"][name]["losses"][i] for r in ranks)
                       for i in range(len(m["losses"]))],
            "vs": {other: statistics.median(a / b for a, b in zip(mine, steps[other][warm:]))
                   for other in ok if other != name},
            # How much the per-round ratio varies: the quartiles (first, third) over the rounds.
            "vs_iqr": {other: _quartiles([a / b for a, b in zip(mine, steps[other][warm:])])
                       for other in ok if other != name},
        }
        if job.device == "cpu":  # on CUDA the phases are launch times, not run times
            n = len(m["phases_s"])
            out[name]["phases_s"] = {ph: statistics.median(max(r["members"][name]["phases_s"][i][ph] for r in ranks)
                                                           for i in range(warm, n))
                                     for ph in m["phases_s"][0]}
    return out
