"""Optional torch.profiler capture of the measured steps (worker side).

Enabled by ``BENCH_PROFILE=<dir>`` in the worker's environment (``benchmarks/studies/profile_step.py``
sets it): each rank writes ``rank<r>.txt`` (operators by self CPU time, and by total time), a
Chrome trace ``rank<r>.trace.json`` and ``rank<r>-initialize.txt`` (cProfile of the system's
initialize) to ``<dir>``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")),
    ("attention", ("scaled_dot_product", "flash_attention")),
    ("other compute", ("gelu", "layer_norm", "embedding", "cross_entropy", "log_softmax", "nll_loss", "softmax")),
    ("optimizer kernel", ("_fused_adam", "_foreach_", "adam")),
    ("grad norm", ("linalg_vector_norm", "norm")),
    ("copy / clone / cast", ("aten::copy_", "aten::clone", "aten::cat", "aten::_to_copy", "aten::contiguous",
                             "aten::index_put", "aten::stack")),
    ("add / scale / fill", ("aten::add_", "aten::mul_", "aten::div_", "aten::fill_", "aten::zero_", "aten::add",
                            "aten::mul", "aten::sum", "aten::div")),
    ("collectives (launch)", ("c10d::", "nccl:", "record_param_comms")),
    ("allocation", ("aten::empty", "aten::zeros", "aten::ones", "aten::new_")),
]


def categorize(events: list[tuple[str, float]], steps: int) -> list[tuple[str, float]]:
    """Self CPU milliseconds per step by operator category (first matching category wins)."""
    totals: dict[str, float] = {}
    for name, self_us in events:
        if name.startswith("gloo:"):  # gloo's collective spans overlap their own ops: not self time
            continue
        cat = next((c for c, keys in CATEGORIES if any(k in name for k in keys)), "other")
        totals[cat] = totals.get(cat, 0.0) + self_us / 1e3 / max(steps, 1)
    return sorted(totals.items(), key=lambda kv: -kv[1])


def profiled_call(fn: Callable[[], T], rank: int, name: str) -> T:
    """Run ``fn``; under ``BENCH_PROFILE`` also cProfile it and write ``rank<r>-<name>.txt`` (top 40 by
    cumulative time), e.g. to see where ``initialize`` spends its time."""
    out = os.environ.get("BENCH_PROFILE")
    if not out:
        return fn()
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    result = prof.runcall(fn)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}-{name}.txt").write_text(buf.getvalue())
    return result


class StepProfiler:
    """Profiles the steps after warm-up when ``BENCH_PROFILE`` is set; otherwise does nothing."""

    def __init__(self, rank: int, warmup_steps: int) -> None:
        self.dir = Path(os.environ["BENCH_PROFILE"]) if os.environ.get("BENCH_PROFILE") else None
        self.rank = rank
        self.warmup_steps = warmup_steps
        self._prof: Any = None
        self._steps = 0

    def step(self, index: int) -> AbstractContextManager[Any]:
        """Context for step ``index``: starts the profiler at the first measured step."""
        if self.dir is None or index < self.warmup_steps:
            return nullcontext()
        self._steps += 1
        if self._prof is None:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], record_shapes=False, with_stack=False)
            self._prof.__enter__()
        return nullcontext()

    def finish(self) -> None:
        """Stop and write the tables and the trace."""
        if self._prof is None or self.dir is None:
            return
        self._prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        ka = self._prof.key_averages()
        steps = self._steps
        cats = categorize([(e.key, e.self_cpu_time_total) for e in ka], steps)
        text = [f"# self CPU ms per step by category ({steps} profiled steps, all threads)",
                *(f"{name:24s} {ms:9.1f}" for name, ms in cats), f"{'total':24s} {sum(v for _, v in cats):9.1f}",
                "# by self CPU time", ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60),
                "# by total CPU time", ka.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60)]
        (self.dir / f"rank{self.rank}.txt").write_text("\n".join(text))
        self._prof.export_chrome_trace(str(self.dir / f"rank{self.rank}.trace.json"))
