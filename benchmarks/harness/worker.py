"""One rank of one benchmark job: ``python -m benchmarks.harness.worker --job JSON --out DIR``.

Launched by :mod:`benchmarks.harness.launch` with torchrun's environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``...). It times ``import torch`` first (nothing above it imports torch), then the
system's import, process-group set-up, the system's initialize, and every training step; and it
writes ``rank<r>.json`` to ``--out``. Exit status: 0 ok or not available, 1 failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", required=True, help="the job, as spec.Job.to_json() writes it")
    p.add_argument("--out", required=True, type=Path, help="directory for rank<r>.json")
    return p.parse_args()


def _write(out: Path, rank: int, result: dict[str, Any]) -> None:
    tmp = out / f".rank{rank}.json"
    tmp.write_text(json.dumps(result))
    tmp.replace(out / f"rank{rank}.json")


def main() -> int:
    """Run the job on this rank and write its result; see the module docstring."""
    args = _args()
    rank = int(os.environ["RANK"])
    result: dict[str, Any] = {"rank": rank, "status": "failed", "reason": "did not finish"}
    t = time.perf_counter()
    import torch  # noqa: F401  (timed: the first import of torch in this process)

    result["import_torch_s"] = time.perf_counter() - t
    # torch.optim.Optimizer.__init__ imports torch._dynamo on first use (seconds on a small CPU):
    # every system here pays it once, so it is timed apart rather than charged to whoever goes first.
    t = time.perf_counter()
    import torch._dynamo  # noqa: F401

    result["import_torch_dynamo_s"] = time.perf_counter() - t
    try:
        _run(args.job, rank, result)
        result["status"] = "ok"
        result.pop("reason", None)
    except Exception as exc:  # record every failure, whatever it is, and let the parent report it
        from benchmarks.harness.systems.base import NotAvailable

        result["status"] = "not available" if isinstance(exc, NotAvailable) else "failed"
        result["reason"] = f"{type(exc).__name__}: {exc}".strip()[:600]
        traceback.print_exc()
    if "zeroshard" in sys.modules:  # which checkout was measured
        result["zeroshard_from"] = str(Path(sys.modules["zeroshard"].__file__ or "").parent)
    try:
        from benchmarks.harness.workload import compile_evidence

        result["compiled"] = compile_evidence()
    except Exception as exc:  # the result must be written whatever happened
        result["compiled"] = {"error": repr(exc)}
    _write(args.out, rank, result)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a peer that failed mid-collective must not make this rank hang.
    os._exit(0 if result["status"] != "failed" else 1)


def _run(job_json: str, rank: int, result: dict[str, Any]) -> None:
    import torch.distributed as dist

    from benchmarks.harness.profiling import profiled_call
    from benchmarks.harness.spec import SIZES, Job
    from benchmarks.harness.systems import get_system
    from benchmarks.harness.workload import batches, build_model, compile_evidence, numel_of, peak_rss_bytes

    job = Job.from_json(job_json)
    t = time.perf_counter()
    for name in dict.fromkeys([job.system] + [m[0] for m in job.members]):
        get_system(name).import_library()
    result["import_system_s"] = time.perf_counter() - t
    result["rss_after_import"] = peak_rss_bytes()

    device = _device(job, rank)
    t = time.perf_counter()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            device_id=device if device.type == "cuda" else None)
    result["init_process_group_s"] = time.perf_counter() - t
    if job.members:
        from benchmarks.harness.paired import run_paired

        run_paired(job, rank, device, result)
        dist.barrier()
        return

    model = build_model(job, device)
    result["numel"] = numel_of(model)
    steps = job.workload.warmup_steps + job.workload.measure_steps
    data = [[(x.to(device), y.to(device)) for x, y in step]
            for step in batches(job, rank, steps, SIZES[job.size].vocab_size)]

    t = time.perf_counter()
    trainer = profiled_call(lambda: get_system(job.system).build(model, job, device), rank, "initialize")
    result["initialize_s"] = time.perf_counter() - t
    result["compiled_by_initialize"] = compile_evidence()
    _train(trainer, data, job, rank, device, result)
    result["peak_rss"] = peak_rss_bytes()
    dist.barrier()


def _device(job: Any, rank: int) -> Any:
    """This rank's device; on CPU, the cores are split evenly between the ranks."""
    import torch

    if job.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // job.world_size))
    return torch.device("cpu")


def _train(trainer: Any, data: list[Any], job: Any, rank: int, device: Any, result: dict[str, Any]) -> None:
    """The timed steps; the memory census runs inside the last one and its time is taken out."""
    import torch

    from benchmarks.harness.profiling import StepProfiler

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, cpu_times, losses, phases = [], [], [], []
    state: dict[str, Any] | None = None
    profiler = StepProfiler(rank, job.workload.warmup_steps)
    for i, micro in enumerate(data):
        measure = i == len(data) - 1 and profiler.dir is None
        t, c = time.perf_counter(), time.process_time()
        with profiler.step(i):
            loss, st = trainer.train_step(micro, measure=measure)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t - (st or {}).get("census_s", 0.0))
        cpu_times.append(time.process_time() - c - (st or {}).get("census_cpu_s", 0.0))
        losses.append(loss)
        phases.append(dict(trainer.phases.seconds))
        state = st or state
    profiler.finish()
    result.update(step_s=times, step_cpu_s=cpu_times, losses=losses, state_bytes=state)
    if device.type == "cpu":
        result["phases_s"] = phases
    else:
        result["peak_device_bytes"] = int(torch.cuda.max_memory_allocated(device))
        result["device_name"] = torch.cuda.get_device_name(device)


if __name__ == "__main__":
    sys.exit(main())
