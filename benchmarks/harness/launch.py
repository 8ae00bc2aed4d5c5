"""Run one job as ``world_size`` fresh worker processes, with a hard deadline; merge their results.

Parent side: no torch import. Each rank is ``python -m benchmarks.harness.worker`` with torchrun's
environment and its own session (process group), so a hung job is killed as a whole.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.paired import merge_paired
from benchmarks.harness.spec import Job

REPO = Path(__file__).resolve().parents[2]
GRACE_S = 15.0
"""How long the other ranks may keep running once one rank has failed."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(job: Job, rank: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    threads = str(max(1, (os.cpu_count() or 1) // job.world_size)) if job.device == "cpu" else "4"
    # This checkout's zeroshard, whatever `pip install -e` points at (and the repository root for `benchmarks`);
    # ZEROSHARD_BENCH_SRC names another checkout's src/ (studies/commit_pair.py times two commits).
    src = env.get("ZEROSHARD_BENCH_SRC", str(REPO / "src"))
    path = [src, str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(job.world_size),
               LOCAL_WORLD_SIZE=str(job.world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS=threads, PYTHONPATH=os.pathsep.join(path), PYTHONUNBUFFERED="1",
               TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
    return env


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the rank's own session: itself and its children
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def run_job(job: Job, work_dir: Path, timeout_s: float, extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``job`` and return its merged result (``status`` is always set).

    ``extra_env`` is added to every rank's environment (``BENCH_PROFILE`` turns the profiler on).
    """
    out = work_dir / job.key
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    port = _free_port()
    load_before = os.getloadavg()[0]
    procs: list[subprocess.Popen[bytes]] = []
    start = time.monotonic()
    for rank in range(job.world_size):
        log = open(out / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed when the child exits
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "benchmarks.harness.worker", "--job", job.to_json(), "--out", str(out)],
            cwd=REPO, env={**_env(job, rank, port), **(extra_env or {})}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        ))
        log.close()
    deadline = start + timeout_s
    failed_at: float | None = None
    timed_out = False
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + GRACE_S):
            timed_out = now > deadline
            _kill(procs)
            break
        time.sleep(0.2)
    ranks = [_read(out / f"rank{r}.json") for r in range(job.world_size)]
    merged = merge(job, ranks)
    merged["wall_s"] = time.monotonic() - start
    merged["load_average"] = [load_before, os.getloadavg()[0]]
    if timed_out and merged["status"] == "ok":
        merged.update(status="failed", reason=f"timeout after {timeout_s:.0f}s")
    merged["logs"] = str(out.relative_to(REPO)) if out.is_relative_to(REPO) else str(out)
    return merged


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def merge(job: Job, ranks: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Combine per-rank results: a step lasts as long as its slowest rank; memory is the max."""
    base: dict[str, Any] = {"job": json.loads(job.to_json()), "key": job.key, "system": job.system,
                            "stage": job.stage, "variant": job.variant, "size": job.size}
    bad = [r for r in ranks if r is None or r.get("status") != "ok"]
    if bad:
        reasons = [r.get("reason", "") for r in bad if r is not None]
        status = "not available" if any(r is not None and r["status"] == "not available" for r in bad) \
            else "failed"
        missing = sum(r is None for r in ranks)
        reason = reasons[0] if reasons else f"{missing} rank(s) wrote no result (killed or crashed); see the logs"
        return {**base, "status": status, "reason": reason}
    rs: list[dict[str, Any]] = ranks  # type: ignore[assignment]
    if job.members:
        return {**base, "status": "ok", "members": merge_paired(job, rs)}
    wl = job.workload
    steps = [max(r["step_s"][i] for r in rs) for i in range(len(rs[0]["step_s"]))]
    measured = steps[wl.warmup_steps :]
    losses = [statistics.fmean(r["losses"][i] for r in rs) for i in range(len(rs[0]["losses"]))]
    tokens = job.world_size * wl.grad_accum * wl.micro_batch * wl.seq_len
    med = statistics.median(measured)
    state = [r["state_bytes"] for r in rs]
    merged = {
        **base, "status": "ok", "numel": rs[0]["numel"], "tokens_per_step": tokens,
        "step_s_all": steps, "step_s_measured": measured, "step_s": med, "step_s_min": min(measured),
        "step_cpu_s": statistics.median(max(r["step_cpu_s"][i] for r in rs) for i in range(wl.warmup_steps,
                                                                                           len(steps))),
        "tokens_per_s": tokens / med,
        "losses": losses, "final_loss": losses[-1],
        "peak_rss": [r["peak_rss"] for r in rs], "rss_after_import": [r["rss_after_import"] for r in rs],
        "state_bytes": max(s["total"] for s in state) if all(state) else None, "state_breakdown": state,
        "import_torch_s": max(r["import_torch_s"] for r in rs),
        "import_system_s": max(r["import_system_s"] for r in rs),
        "init_process_group_s": max(r["init_process_group_s"] for r in rs),
        "initialize_s": max(r["initialize_s"] for r in rs),
        "import_torch_dynamo_s": max(r["import_torch_dynamo_s"] for r in rs),
        "compiled_by_initialize": rs[0]["compiled_by_initialize"],
        "zeroshard_from": rs[0].get("zeroshard_from"),
        "compiled": rs[0]["compiled"],
    }
    if "phases_s" in rs[0]:
        merged["phases_s"] = {ph: statistics.median(max(r["phases_s"][i][ph] for r in rs)
                                                    for i in range(wl.warmup_steps, len(steps)))
                              for ph in rs[0]["phases_s"][0]}
    if "peak_device_bytes" in rs[0]:
        merged["peak_device_bytes"] = max(r["peak_device_bytes"] for r in rs)
        merged["device_name"] = rs[0]["device_name"]
    return merged
