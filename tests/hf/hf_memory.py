"""Resident memory of ZeRO-3 ``from_pretrained`` (issue 13): the worker that measures it, shared by
``tests/hf/test_hf_from_pretrained_memory.py`` and ``benchmarks/studies/hf_from_pretrained_memory.py``.

Each rank loads the same saved model twice in one process: first partitioned (a live
``HfDeepSpeedConfig`` at stage 3: transformers builds the model under ``zero.Init`` and copies the
weights in module by module with ``GatheredParameters(modifier_rank=0)``, rank 0 reading the
checkpoint), then unsharded (no DeepSpeed config), each after a warm-up load of a tiny model of
the same class through the same path (imports, code pages). For each load it records, relative
to the resident memory just before it (``VmRSS``, with the peak reset there through
``/proc/self/clear_refs``):

* ``after``: the growth of ``VmRSS`` once ``from_pretrained`` has returned (the model kept);
* ``read``: the same after every parameter value this rank holds was read once. Unsharded,
  transformers leaves the parameters as views of the memory-mapped checkpoint, so their pages
  become resident (file-backed, copy-on-write once training writes them) only when read;
* ``peak``: the growth of ``VmHWM``, the highest resident memory during the load;
* ``peak_anon`` / ``peak_file``: the highest ``RssAnon`` (heap and anonymous mappings) and
  ``RssFile`` (pages of mapped files: the safetensors checkpoint) seen by a thread that samples
  ``/proc/self/status`` every millisecond (a sample, so a lower bound of the true peaks).

The unsharded load comes second, in a process whose heap the first load has already grown; glibc
may serve it from pages it kept, so its figures are if anything too low, which only makes the
comparison with the partitioned load harder to pass.
"""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path
from typing import Any

import hf_workers as W
import torch
from rss import reset_peak

_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")

#: The measured model: 58M parameters, 222 MiB in fp32; the embedding and the LM head (62.5 MiB
#: each) are the largest parameters.
MODEL = {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 128}
#: The warm-up model (same class, same code paths).
TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def save_models(root: Path, model: dict[str, int]) -> tuple[Path, Path]:
    """``root/model`` (a Llama with the ``model`` config) and ``root/tiny``, saved with ``save_pretrained``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    for name, cfg in (("model", model), ("tiny", TINY)):
        LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(root / name)
    return root / "model", root / "tiny"


def status() -> dict[str, int]:
    """Bytes of ``VmRSS``, ``VmHWM``, ``RssAnon`` and ``RssFile`` of this process."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in _FIELDS:
                out[key] = int(value.split()[0]) * 1024
    return out


class Sampler:
    """Highest ``RssAnon`` and ``RssFile`` seen while the block runs, sampled every ``interval`` s."""

    def __init__(self, interval: float = 1e-3) -> None:
        self.interval = interval
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = status()
            for key in self.peak:
                self.peak[key] = max(self.peak[key], now[key])
            time.sleep(self.interval)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def _measured_load(path: str) -> tuple[torch.nn.Module, dict[str, int]]:
    """``from_pretrained(path)`` with the growth of this process's memory over the load (and
    ``base``, the RSS it grows from)."""
    from transformers import AutoModelForCausalLM

    from zeroshard.core import host_memory

    gc.collect()
    host_memory.trim()  # start from a heap without free pages kept from before
    base = {**status(), **reset_peak()}
    with Sampler() as sampler:
        model = AutoModelForCausalLM.from_pretrained(path)
    end = status()
    return model, {"after": end["VmRSS"] - base["VmRSS"], "peak": end["VmHWM"] - base["VmRSS"],
                   "peak_anon": sampler.peak["RssAnon"] - base["RssAnon"],
                   "peak_file": sampler.peak["RssFile"] - base["RssFile"], "base": base["VmRSS"]}


def _held(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameter values this rank holds: its ``zero.Init`` chunks, or the whole parameters."""
    from zeroshard.core.partition import INIT_CHUNK_ATTR

    return [getattr(p, INIT_CHUNK_ATTR, p.data) for p in model.parameters()]


def _read_everything(model: torch.nn.Module, growth: dict[str, int], base_rss: int) -> None:
    """Read every value this rank holds; record ``held`` (bytes) and ``read`` (RSS growth)."""
    held = _held(model)
    with torch.no_grad():
        for t in held:
            t.sum()
    growth["held"] = sum(t.numel() * t.element_size() for t in held)
    growth["read"] = status()["VmRSS"] - base_rss


def _chunk_sums(model: torch.nn.Module) -> dict[str, float]:
    """Per parameter, the sum (float64) of its values over every rank's chunk: the sum of the
    whole loaded tensor, to check that the partitioned load loaded the checkpoint's values."""
    import torch.distributed as dist

    from zeroshard.core.partition import INIT_CHUNK_ATTR

    names = [n for n, _ in model.named_parameters()]
    chunks = [getattr(p, INIT_CHUNK_ATTR) for p in model.parameters()]
    sums = torch.tensor([float(c.sum(dtype=torch.float64)) for c in chunks], dtype=torch.float64)
    dist.all_reduce(sums)
    return dict(zip(names, sums.tolist(), strict=True))


def load_memory_worker(rank: int, world: int, model_dir: str, tiny_dir: str) -> dict[str, Any]:
    """Warm up on ``tiny_dir``, then load ``model_dir`` partitioned (ZeRO-3) and unsharded."""
    W.enable_layer()
    from transformers.integrations import HfDeepSpeedConfig

    cfg3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    live = HfDeepSpeedConfig(cfg3)  # kept alive: from_pretrained builds under zero.Init while it exists
    _measured_load(tiny_dir)  # warm-up: the same code paths on a tiny model
    model, sharded = _measured_load(model_dir)
    _read_everything(model, sharded, sharded.pop("base"))
    sums = _chunk_sums(model)
    del model, live
    _measured_load(tiny_dir)
    model, unsharded = _measured_load(model_dir)
    _read_everything(model, unsharded, unsharded.pop("base"))
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    del model
    return {"sharded": sharded, "unsharded": unsharded, "model_bytes": unsharded["held"],
            "largest_param_bytes": largest, "sums": sums}
