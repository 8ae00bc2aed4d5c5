"""Activation memory of the 25M GPT with and without activation offload (DeepSpeed's
``CheckpointHiddenStatesOffload``, ``zeroshard.activations.HiddenStatesOffload``).

    python benchmarks/activation_offload_memory.py [--seq 1024] [--batch 1] [--device cpu|cuda] [--out FILE]

The model is ``examples/gpt.py`` at the benchmarks' 25M size (8 blocks, dim 512, 8 heads, byte
vocabulary), fp32, dropout 0. Its forward is GPT's own, each block run under torch's non-reentrant
checkpoint and its input marked for the active manager, as the Hugging Face marker does for
``GradientCheckpointingLayer``. Rows: no checkpointing; one checkpoint per block; plus offload with
``keep_last_count`` 1 (DeepSpeed's default) and 0; on CPU also DeepSpeed's defaults as they are
(marked host tensors are skipped: nothing moves).

Columns, one forward and backward each:

- **device-side saved**: bytes the autograd graph holds for backward when forward ends, where the
  training device's memory would hold them: the distinct storages of every saved tensor kept as it
  is (parameters excluded), plus the marked inputs kept on the device (``keep_last_count``). This is
  the peak of what a step holds for backward (nothing is saved after forward ends) and what
  offload is for; it is counted by the manager's own pack hook, so it is the same number on CPU and
  on CUDA;
- **host buffers**: bytes of the host copies holding the offloaded inputs when forward ends;
- **CPU peak**: the peak of live bytes in torch's CPU allocator over forward + backward
  (profiler memory events), with a new manager whose host buffers are allocated during the run.
  On a CPU run device and host are the same RAM: this is the total, and offload cannot lower it;
- **CPU peak without the host buffers**: the same, run again with the manager whose pool already
  holds the buffers (allocated before the profiler starts, so they are not counted): the peak of
  everything but the host copies over forward + backward, the stand-in for the device's peak;
- **CUDA peak** (``--device cuda``): ``torch.cuda.max_memory_allocated`` over forward + backward,
  minus what was allocated before (weights, gradients), the real device figure;

On a CPU run the offload rows use ``offload_cpu_tensors=True``: the marked inputs are copied into
host buffers and back exactly as from a GPU, and the graph then holds the buffer, not the tensor,
so the device-side column shows what would leave a GPU. It is an accounting of bytes, not a
measurement of a GPU's allocator (no caching-allocator rounding or fragmentation, no recompute
temporaries); run with ``--device cuda`` on a GPU for that.
"""

from __future__ import annotations

import argparse
import functools
import gc
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.studies.activation_memory import profiled_cpu_peak  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from zeroshard.activations import HiddenStatesOffload, OffloadStats, current_offload  # noqa: E402

MiB = 2**20


class Accounting(HiddenStatesOffload):
    """A manager that also records the storages of the saved tensors it keeps as they are."""

    def __init__(self, weights: set[int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.weights = weights
        self.kept: dict[int, int] = {}

    def _pack_tensor(self, tensor: torch.Tensor) -> Any:
        packed = super()._pack_tensor(tensor)
        if packed is tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self.weights:
                self.kept[storage.data_ptr()] = storage.nbytes()
        return packed

    def device_side_bytes(self) -> int:
        held = dict(self.kept)
        for t in self._keep_last.values():
            held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(held.values())


def loss_of(model: GPT, idx: torch.Tensor, checkpointed: bool, mark: bool) -> torch.Tensor:
    """GPT.forward with each block checkpointed and (``mark``) its input marked for the active manager."""
    pos = torch.arange(idx.size(1), device=idx.device)
    x = model.drop(model.wte(idx) + model.wpe(pos))
    for block in model.blocks:
        if checkpointed:
            offload = current_offload()
            if mark and offload is not None:
                offload.mark(x)
            x = checkpoint(block, x, use_reentrant=False)
        else:
            x = block(x)
    logits = model.lm_head(model.ln_f(x))
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), idx.roll(-1, 1).reshape(-1))


ROWS: dict[str, tuple[bool, dict[str, Any] | None]] = {
    "no checkpointing": (False, None),
    "checkpoint per block": (True, None),
    "checkpoint + offload, keep_last_count=1": (True, {"keep_last_count": 1}),
    "checkpoint + offload, keep_last_count=0": (True, {"keep_last_count": 0}),
}
CPU_ONLY = {"checkpoint + offload, DeepSpeed defaults (CPU: skipped)": (True, {"keep_last_count": 1, "cpu": False})}


def _manager(model: GPT, options: dict[str, Any] | None, dev: torch.device) -> Accounting:
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    if options is None:
        return Accounting(weights)  # nothing is marked: it only counts
    options = dict(options)
    return Accounting(weights, keep_last_count=options["keep_last_count"],
                      offload_cpu_tensors=options.pop("cpu", True) and dev.type == "cpu")


def _cpu_peak(run: Any) -> int:
    return profiled_cpu_peak(run)


def _cuda_peak(run: Any) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=args.seq, n_layer=8, n_head=8, n_embd=512, dropout=0.0)).to(dev)
    idx = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).to(dev)
    rows = []
    for name, (checkpointed, options) in {**ROWS, **(CPU_ONLY if dev.type == "cpu" else {})}.items():
        mark = options is not None
        with _manager(model, options, dev):  # warm-up: code paths loaded, gradients allocated
            loss_of(model, idx[:, :64], checkpointed, mark).backward()
        gc.collect()
        manager = _manager(model, options, dev)
        with manager:
            loss = loss_of(model, idx, checkpointed, mark)
            device_side, stats = manager.device_side_bytes(), OffloadStats(**vars(manager.stats))
            loss.backward()
        del loss
        gc.collect()

        def run(manager: Accounting, checkpointed: bool = checkpointed, mark: bool = mark) -> None:
            with manager:
                loss_of(model, idx, checkpointed, mark).backward()

        measure_peak = _cuda_peak if dev.type == "cuda" else _cpu_peak
        # a new manager allocates its host buffers during the run: they count in the peak
        peak = measure_peak(functools.partial(run, _manager(model, options, dev)))
        # the first manager reuses the buffers of its pool, allocated before: they do not
        peak_without_host = measure_peak(functools.partial(run, manager)) if dev.type == "cpu" else peak
        model.zero_grad(set_to_none=False)
        rows.append({"mode": name, "device_side": device_side, "host": stats.host_bytes, "peak": peak,
                     "peak_without_host": peak_without_host,
                     "offloaded": stats.offloaded_tensors, "skipped": stats.skipped_marked_tensors})
    return rows


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    cuda = args.device == "cuda"
    peak = "CUDA peak" if cuda else "CPU peak, MiB | CPU peak without the host buffers"
    lines = [f"25M GPT (8 x 512, byte vocabulary), fp32, batch {args.batch} x {args.seq} tokens, {args.device}, "
             f"torch {torch.__version__}",
             "",
             f"| mode | device-side saved, MiB | host buffers, MiB | inputs offloaded / skipped | {peak}, MiB |",
             "| --- | ---: | ---: | ---: | ---: |" + ("" if cuda else " ---: |")]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['device_side'] / MiB:.1f} | {r['host'] / MiB:.1f} | "
                     f"{r['offloaded']} / {r['skipped']} | {r['peak'] / MiB:.1f} |"
                     + ("" if cuda else f" {r['peak_without_host'] / MiB:.1f} |"))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--out", type=Path, help="also write the table to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    text = table(measure(args), args)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
