"""The shared workload (model, data, measurements) every system trains, worker side only.

Same GPT (``examples/gpt.py``), same initial weights (seeded), same byte-level batches of
``examples/data/sonnets.txt`` for every system: so final losses are comparable, and fp32 runs of
equivalent systems should agree to a few decimal places.
"""

from __future__ import annotations

import gc
import resource
import sys
import time
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.spec import SIZES, Job

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
CORPUS = EXAMPLES / "data" / "sonnets.txt"

MicroBatch = tuple[torch.Tensor, torch.Tensor]


def build_model(job: Job, device: torch.device) -> torch.nn.Module:
    """The GPT of ``job.size`` in fp32, built and initialised on ``device`` from ``job.workload.seed``
    (on the GPU directly: initialising a billion parameters on the CPU takes a while)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    from gpt import GPT, GPTConfig  # examples/gpt.py

    size = SIZES[job.size]
    cfg = GPTConfig(vocab_size=size.vocab_size, block_size=size.positions or job.workload.seq_len,
                    n_layer=size.n_layer, n_head=size.n_head, n_embd=size.n_embd, dropout=0.0, bias=True,
                    tie_weights=size.tie_weights)
    torch.manual_seed(job.workload.seed)
    with device:
        return GPT(cfg)


def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks (FSDP2 shards one unit per block)."""
    return list(model.blocks)  # type: ignore[arg-type]


def batches(job: Job, rank: int, steps: int, vocab_size: int) -> list[list[MicroBatch]]:
    """``steps`` optimizer steps of this rank's micro-batches (inputs, next-token targets).

    Step ``i`` draws ``world · grad_accum · micro_batch`` windows of the corpus from a generator
    seeded by ``(seed, i)``; rank ``r`` takes its rows, so the global batch is the same whatever
    the system.
    """
    wl = job.workload
    data = torch.tensor(list(CORPUS.read_bytes()), dtype=torch.long) % vocab_size
    out: list[list[MicroBatch]] = []
    for step in range(steps):
        g = torch.Generator().manual_seed(wl.seed * 100_003 + step)
        n = job.world_size * wl.grad_accum * wl.micro_batch
        starts = torch.randint(0, data.numel() - wl.seq_len - 1, (n,), generator=g)
        window = torch.stack([data[s : s + wl.seq_len + 1] for s in starts.tolist()])
        micro = []
        for m in range(wl.grad_accum):
            row = (m * job.world_size + rank) * wl.micro_batch
            w = window[row : row + wl.micro_batch]
            micro.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
        out.append(micro)
    return out


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _local(t: torch.Tensor) -> torch.Tensor | None:
    local = getattr(t, "_local_tensor", None)  # DTensor (FSDP2): count the shard this rank holds
    if isinstance(local, torch.Tensor):
        return local
    return None if t.is_meta else t


def timed_census(roots: Iterable[Any]) -> dict[str, Any]:
    """:func:`tensor_census` as ``{"census": bytes, "census_s": wall seconds, "census_cpu_s": CPU seconds}``."""
    t, c = time.perf_counter(), time.process_time()
    n = tensor_census(roots)
    return {"census": n, "census_s": time.perf_counter() - t, "census_cpu_s": time.process_time() - c}


def tensor_census(roots: Iterable[Any], max_depth: int = 12) -> int:
    """Bytes of the distinct tensor storages reachable from ``roots`` (and their ``.grad``).

    A system-agnostic count of the model state a training object holds: it walks attributes,
    containers and optimizer state, and counts each underlying storage once (so a parameter that
    is a view of a flat buffer, or DDP gradients that are views of its buckets, count once).
    Tensors held only by C++ (not reachable from Python) are invisible to it.
    """
    seen_obj: set[int] = set()
    storages: dict[tuple[str, int], int] = {}
    skip = (str, bytes, int, float, bool, type(None), types.ModuleType, types.FunctionType,
            types.BuiltinFunctionType, types.MethodType, type)

    def visit(obj: Any, depth: int) -> None:
        if depth > max_depth or isinstance(obj, skip) or id(obj) in seen_obj:
            return
        seen_obj.add(id(obj))
        if isinstance(obj, torch.Tensor):
            t = _local(obj)
            if t is not None and t.device.type != "meta":
                try:
                    st = t.untyped_storage()
                    storages[(str(t.device), st.data_ptr())] = st.nbytes()
                except (RuntimeError, NotImplementedError):
                    pass
            grad = obj.grad if obj.is_leaf else None
            if grad is not None:
                visit(grad, depth + 1)
            return
        if isinstance(obj, dict):
            for k, v in obj.items():
                visit(k, depth + 1)
                visit(v, depth + 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for v in obj:
                visit(v, depth + 1)
        elif isinstance(obj, torch.nn.Module):
            for t in list(obj.parameters()) + list(obj.buffers()):
                visit(t, depth + 1)
            visit(vars(obj), depth + 1)
        elif hasattr(obj, "__dict__"):
            visit(vars(obj), depth + 1)

    with torch.no_grad():
        for r in roots:
            visit(r, 0)
    gc.collect()
    return sum(storages.values())


def compile_evidence() -> dict[str, Any]:
    """What this process compiled or loaded from a JIT build: C++ extension modules loaded from the
    torch-extensions cache (DeepSpeed's ops) and frames compiled by ``torch.compile``."""
    jit = sorted(name for name, mod in list(sys.modules.items())
                 if "torch_extensions" in str(getattr(mod, "__file__", "") or ""))
    frames = 0
    dynamo = sys.modules.get("torch._dynamo.utils")
    if dynamo is not None:
        frames = int(dynamo.counters["frames"].get("ok", 0))
    return {"jit_extensions": jit, "compiled_frames": frames}


def numel_of(model: torch.nn.Module) -> int:
    """Trainable parameter count (each shared tensor once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
