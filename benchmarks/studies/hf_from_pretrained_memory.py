"""Resident memory of Hugging Face ``from_pretrained`` under ZeRO-3, per rank, against unsharded.

    python benchmarks/studies/hf_from_pretrained_memory.py [--world 2] [--layers 8] [--hidden 512] [--vocab 32000]

Saves a Llama (``save_pretrained``, safetensors) and, on ``--world`` spawned gloo ranks with
``zeroshard.deepspeed.imports`` enabled, loads it with ``AutoModelForCausalLM.from_pretrained`` under a
live ``HfDeepSpeedConfig`` at stage 3 (transformers builds it under ``zero.Init`` and copies the
weights in with ``GatheredParameters(modifier_rank=0)``, rank 0 reading the checkpoint), then
unsharded in the same processes. The measuring worker is the test's (``tests/hf/hf_memory.py``,
whose docstring defines every figure: growth of ``VmRSS`` after loading and after reading every
value held, growth of ``VmHWM`` during loading after a ``clear_refs`` reset, and the sampled peaks
of anonymous and file-backed pages). Needs Linux ``/proc``, transformers and accelerate
(``pip install 'zeroshard[hf]'``). Prints a Markdown table and writes it to
``benchmarks/results/hf_from_pretrained_memory.md``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "hf")]

import hf_memory  # noqa: E402  (tests/hf: the measuring worker the test uses)
from harness import run_distributed  # noqa: E402

MiB = 2**20


def table(ranks: list[dict[str, Any]], args: argparse.Namespace) -> str:
    model = ranks[0]["model_bytes"]
    lines = [
        f"ZeRO-3 `from_pretrained`, Llama hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab} "
        f"({model / MiB:.1f} MiB in fp32, largest parameter {ranks[0]['largest_param_bytes'] / MiB:.1f} MiB), "
        f"{args.world} gloo ranks on CPU. Growth over the process's memory just before the load, MiB "
        "(fraction of the fp32 model).", "",
        "| rank | load | held | after loading | after reading every value | peak (VmHWM) | of which file pages "
        "(sampled) | anonymous peak (sampled) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for rank, r in enumerate(ranks):
        for kind, label in (("sharded", "ZeRO-3 (partitioned)"), ("unsharded", "unsharded")):
            m = r[kind]
            cells = [f"{m[k] / MiB:.1f} ({m[k] / model:.2f})" for k in ("held", "after", "read", "peak")]
            cells += [f"{m['peak_file'] / MiB:.1f}", f"{m['peak_anon'] / MiB:.1f}"]
            lines.append(f"| {rank} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layers", type=int, default=hf_memory.MODEL["num_hidden_layers"])
    p.add_argument("--hidden", type=int, default=hf_memory.MODEL["hidden_size"])
    p.add_argument("--vocab", type=int, default=hf_memory.MODEL["vocab_size"])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hf_from_pretrained_memory.md"))
    args = p.parse_args()
    config = {**hf_memory.MODEL, "num_hidden_layers": args.layers, "hidden_size": args.hidden,
              "vocab_size": args.vocab, "intermediate_size": int(args.hidden * 2.6875)}
    with tempfile.TemporaryDirectory(prefix="hf-memory-") as tmp:
        model_dir, tiny_dir = hf_memory.save_models(Path(tmp), config)
        ranks = run_distributed(hf_memory.load_memory_worker, args.world, str(model_dir), str(tiny_dir), timeout=1800)
    text = table(ranks, args)
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
