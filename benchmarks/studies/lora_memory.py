"""LoRA on a large frozen base under ZeRO-3: real resident memory and step time, zeroshard against DeepSpeed.

    python benchmarks/studies/lora_memory.py [--layers 64] [--width 1024] [--steps 6] [--systems zeroshard,deepspeed]

The model is the memory test's (``tests/lora_model.py``: bias-free frozen linear layers, as in
Llama, each with rank-8 trainable adapters), built under each system's ``zero.Init`` (as
transformers' ZeRO-3 ``from_pretrained`` builds it) and trained at stage 3 in fp32 on 2 gloo
ranks, fresh processes per system and setting: at the defaults, and with about one layer live
(``stage3_max_live_parameters`` and ``stage3_prefetch_bucket_size`` of one layer, FSDP2's
``reshard_after_forward=True``). Figures per rank (the larger rank): growth of RSS over a baseline
taken just before the model is built (after a one-layer warm-up run of the same system), peak
(``VmHWM``, through build, initialize and training) and after training (``VmRSS``), as MiB and as
a fraction of the fp32 frozen model; median step time over the second half of the steps. Needs Linux ``/proc``; the
DeepSpeed rows need ``pip install 'zeroshard[deepspeed]'``. Prints a Markdown table and writes it
to ``benchmarks/results/lora_memory.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests")]

import rss  # noqa: E402  (tests/rss.py)
import torch  # noqa: E402
from harness import run_distributed  # noqa: E402
from lora_model import adapted_stack  # noqa: E402

MiB = 2**20


def _config(width: int, one_layer: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 3}
    if one_layer:
        zero.update(stage3_max_live_parameters=width * width, stage3_prefetch_bucket_size=width * width)
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "steps_per_print": 1_000_000_000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True, "fused": True}},
            "zero_optimization": zero}


def _run(system: str, layers: int, width: int, one_layer: bool, steps: int, rank: int) -> dict[str, Any]:
    """Build under the system's zero.Init, initialize, train; the step times."""
    cfg = _config(width, one_layer)
    if system == "zeroshard":
        import zeroshard as lib
    else:
        import deepspeed as lib  # type: ignore[no-redef]
    torch.manual_seed(0)
    with lib.zero.Init(config_dict_or_path=cfg):
        model = adapted_stack(layers, width)
    engine, *_ = lib.initialize(model=model, config=cfg,
                                model_parameters=[p for p in model.parameters() if p.requires_grad])
    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps):
        x = torch.randn(4, width, generator=g)
        start = time.perf_counter()
        engine.backward(engine(x).square().mean())
        engine.step()
        times.append(time.perf_counter() - start)
    return {"times": times, "params": sum(p.numel() for p in model.parameters())}


def worker(rank: int, world: int, system: str, layers: int, width: int, one_layer: bool,
           steps: int) -> dict[str, Any]:
    """One rank: a one-layer warm-up run, the baseline, then the measured run."""
    _run(system, 1, width, one_layer, 2, rank)
    base = rss.reset_peak()  # the memory test's reset: garbage collected, VmHWM := VmRSS
    out = _run(system, layers, width, one_layer, steps, rank)
    now = rss.status()
    return {**out, "peak": now["VmHWM"] - base["VmRSS"], "current": now["VmRSS"] - base["VmRSS"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--systems", default="zeroshard,deepspeed")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lora_memory.md"))
    args = p.parse_args()
    os.environ.pop("ZEROSHARD_MALLOC_TRIM", None)
    frozen = 4 * args.layers * args.width * args.width
    runs: dict[tuple[str, bool], list[tuple[int, int, float]]] = {}
    for _ in range(args.repeat):  # systems alternate, so that they see the same machine load
        for one_layer in (False, True):
            for system in args.systems.split(","):
                ranks = run_distributed(worker, 2, system, args.layers, args.width, one_layer, args.steps,
                                        timeout=1200)
                # the second half of the steps: the first ones settle (pages faulted in, buffers made)
                step = statistics.median(max(r["times"][i] for r in ranks) for i in range(args.steps // 2, args.steps))
                runs.setdefault((system, one_layer), []).append(
                    (max(r["peak"] for r in ranks), max(r["current"] for r in ranks), step))
                print(system, "one layer live" if one_layer else "defaults", runs[system, one_layer][-1], flush=True)
    rows = [(system, "one layer live" if one_layer else "defaults", *(statistics.median(x[i] for x in v)
                                                                      for i in range(3)))
            for (system, one_layer), v in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0] != "zeroshard"))]
    lines = [f"LoRA (rank 8) on a frozen base of {args.layers} bias-free {args.width} x {args.width} linear layers "
             f"({frozen / MiB:.0f} MiB in fp32), built under `zero.Init`, ZeRO-3, fp32, 2 gloo ranks, micro batch 4, "
             f"{args.steps} steps, {args.repeat} runs per row in fresh processes, the systems alternating "
             "(`python benchmarks/studies/lora_memory.py`). RSS growth per rank over the baseline (the larger rank), "
             "MiB and fraction of the frozen model; step: median of the second half of the steps (slowest rank); "
             "each figure the median over the runs.", "",
             "| system | setting | peak | after training | step (s) |", "|---|---|---:|---:|---:|"]
    for system, setting, peak, current, step in rows:
        lines.append(f"| {system} | {setting} | {peak / MiB:.0f} ({peak / frozen:.2f}) | "
                     f"{current / MiB:.0f} ({current / frozen:.2f}) | {step:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
