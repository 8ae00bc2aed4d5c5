"""The FLOPs profiler's report, laid out as DeepSpeed's ``print_model_profile``.

Three parts: the summary (sizes, forward FLOPs and latency, the step's FLOP/s and the MFU), the
top ``top_modules`` module classes per depth by parameters, FLOPs and latency, and, when
``detailed``, the module tree with each module's figures. Depth 0 is the model; both lists stop
at ``module_depth`` (-1: no limit). DeepSpeed reports MACs; torch's counter gives FLOPs, and every
operator it counts does two FLOPs per multiply-accumulate, so MACs are FLOPs / 2.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zeroshard.errors import ConfigError
from zeroshard.profiling.profile import ModuleProfile, StepProfile

logger = logging.getLogger("zeroshard")

_RULE = "------------------------------------------------------------------------------"


def number_to_string(num: float, precision: int = 2) -> str:
    """``1.23 G``: DeepSpeed's scaled number (T, G, M, K, m, u)."""
    for magnitude, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if num >= magnitude:
            return f"{round(num / magnitude, precision):g} {unit}"
    if num >= 1 or num == 0:
        return f"{round(num, precision):g} "
    if num >= 1e-3:
        return f"{round(num * 1e3, precision):g} m"
    return f"{round(num * 1e6, precision):g} u"


def params_to_string(n: float) -> str:
    """``124.44 M`` parameters (``B`` for billions, as DeepSpeed)."""
    return number_to_string(n).replace("G", "B").strip()


def flops_to_string(n: float) -> str:
    return number_to_string(n) + "FLOPS"


def duration_to_string(seconds: float) -> str:
    return number_to_string(seconds) + "s"


def _pct(part: float, whole: float) -> str:
    return f"{round(100 * part / whole, 2):g}%" if whole else "0%"


def summary_lines(p: StepProfile) -> list[str]:
    """The summary block: what DeepSpeed prints with ``wall_clock_breakdown``, plus peak and MFU."""
    f = "{:<70}  {:<8}".format
    flops_line = f"FLOPS per GPU = {p.flops_factor:g} * fwd flops per GPU / iter latency: "
    mfu = f"{100 * p.mfu:.2f}%" if p.mfu is not None else "unknown"
    peak = f"{flops_to_string(p.peak)} ({p.peak_source})" if p.peak else p.peak_source
    return [
        f"Profile Summary at step {p.step}:",
        "Notations:\ndata parallel size (dp_size), number of parameters (params), number of multiply-accumulate "
        "operations (MACs),\nnumber of floating-point operations (flops), floating-point operations per second "
        "(FLOPS),\nfwd latency (forward propagation latency), iter latency (from the step's first forward to "
        "the end of its optimizer step),\nMFU (model FLOPs utilisation: FLOPS per GPU / peak FLOPS per GPU)\n",
        f("world size: ", p.world_size),
        f("data parallel size: ", p.world_size),
        f("batch size per GPU: ", p.micro_batch),
        f("params per GPU: ", params_to_string(p.model.params)),
        f("fwd MACs per GPU: ", number_to_string(p.fwd_flops / 2) + "MACs"),
        f("fwd flops per GPU: ", number_to_string(p.fwd_flops)),
        f("fwd latency: ", duration_to_string(p.fwd_latency)),
        f("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ",
          flops_to_string(p.fwd_flops / p.fwd_latency if p.fwd_latency else 0)),
        f("iter latency: ", duration_to_string(p.iter_latency)),
        f(flops_line, flops_to_string(p.flops_per_s)),
        f("peak FLOPS per GPU: ", peak),
        f("MFU = FLOPS per GPU / peak FLOPS per GPU: ", mfu),
    ]


def _max_depth(model: ModuleProfile, module_depth: int) -> int:
    deepest = max(m.depth for m in model.walk())
    return deepest if module_depth < 0 else min(module_depth, deepest)


def aggregated_lines(model: ModuleProfile, module_depth: int, top_modules: int) -> list[str]:
    """Per depth, the ``top_modules`` module classes with the most parameters, FLOPs and latency."""
    lines = [f"Top {top_modules} modules in terms of params, FLOPs or fwd latency at different model depths:"]
    for d in range(_max_depth(model, module_depth) + 1):
        by_kind: dict[str, list[float]] = {}
        for m in model.walk():
            if m.depth == d:
                acc = by_kind.setdefault(m.kind, [0.0, 0.0, 0.0])
                acc[0] += m.params
                acc[1] += m.flops
                acc[2] += m.duration

        lines += [f"depth {d}:", f"    params      - {_top(by_kind, 0, top_modules, params_to_string)}",
                  f"    flops       - {_top(by_kind, 1, top_modules, number_to_string)}",
                  f"    fwd latency - {_top(by_kind, 2, top_modules, duration_to_string)}"]
    return lines


def _top(by_kind: dict[str, list[float]], i: int, n: int, fmt: Callable[[float], str]) -> dict[str, str]:
    """The ``n`` classes with the largest figure ``i``, formatted."""
    ranked = sorted(by_kind.items(), key=lambda kv: kv[1][i], reverse=True)[:n]
    return {k: fmt(v[i]) for k, v in ranked}


def tree_lines(model: ModuleProfile, module_depth: int) -> list[str]:
    """The module tree as ``print(model)`` shows it, each module's figures in its parentheses."""
    limit = _max_depth(model, module_depth)
    lines: list[str] = []

    def visit(m: ModuleProfile, indent: str) -> None:
        figures = (f"{params_to_string(m.params)} = {_pct(m.params, model.params)} Params, "
                   f"{number_to_string(m.flops)}FLOPs = {_pct(m.flops, model.flops)} FLOPs, "
                   f"{duration_to_string(m.duration)} = {_pct(m.duration, model.duration)} latency, "
                   f"{flops_to_string(m.flops / m.duration if m.duration else 0)}")
        label = f"({m.name.rsplit('.', 1)[-1]}): " if m.depth else ""
        shown = [c for c in m.children if c.depth <= limit]
        if not shown:
            lines.append(f"{indent}{label}{m.kind}({figures})")
            return
        lines.append(f"{indent}{label}{m.kind}(")
        lines.append(f"{indent}  {figures}")
        for c in shown:
            visit(c, indent + "  ")
        lines.append(f"{indent})")

    visit(model, "")
    return lines


def format_profile(p: StepProfile, module_depth: int = -1, top_modules: int = 1, detailed: bool = True) -> str:
    """The whole report as text."""
    lines = ["", "-------------------------- zeroshard Flops Profiler --------------------------"]
    lines += summary_lines(p)
    lines += ["", "----------------------------- Aggregated Profile per GPU -----------------------------"]
    lines += aggregated_lines(p.model, module_depth, top_modules)
    if detailed:
        lines += ["", "------------------------------ Detailed Profile per GPU ------------------------------",
                  "Each module profile is listed after its name in the following order: \nparams, percentage of "
                  "total params, FLOPs, percentage of total FLOPs, fwd latency, percentage of total fwd latency, "
                  "fwd FLOPS",
                  "\nNote: FLOPs are counted by torch.utils.flop_counter (matrix products, convolutions, attention "
                  "kernels with a formula); element-wise operations are not counted. A parent's FLOPs and latency "
                  "include work done in its own forward outside its submodules.\n"]
        lines += tree_lines(p.model, module_depth)
    lines.append(_RULE)
    return "\n".join(lines)


def write_profile(p: StepProfile, cfg: Any) -> str:
    """Write the report of ``p`` to ``cfg.output_file``, or log it when there is none; returns it."""
    text = format_profile(p, int(cfg.module_depth), int(cfg.top_modules), bool(cfg.detailed))
    if not cfg.output_file:
        logger.info("%s", text)
        return text
    path = Path(cfg.output_file)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    except OSError as e:
        raise ConfigError(f"cannot write the profile to {str(path)!r}: {e}", key="flops_profiler.output_file") from e
    logger.info("flops profile of step %d written to %s", p.step, path)
    return text
