"""A LoRA fine-tune under ZeRO-3 holds its chunk of the frozen base model, in real resident memory.

The base model (64 frozen 1024 x 1024 linear layers without biases, as in Llama: 67M parameters,
256 MiB in fp32) is built under ``zero.Init``, as transformers' ZeRO-3 ``from_pretrained`` builds
it; rank-8 adapters train, at stage 3 on 2 ranks with a live budget of about one layer (the setting of
FSDP2's ``reshard_after_forward=True``, README "Memory"). Each rank's RSS, over a baseline taken
just before the model is built, must stay below 70% of the frozen model at its peak through
initialize and 2 steps (its half, 50%, plus a few gathered layers and the adapters' state), and
the memory it holds after the steps below 65%. Before stage 3 partitioned frozen parameters, each
rank held them whole: over 100%.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import rss
import torch
from harness import run_distributed
from lora_model import adapted_stack

import zeroshard

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")

MiB = 2**20
WIDTH, LAYERS = 1024, 64


def _run(layers: int, rank: int) -> int:
    """Build under zero.Init, initialize at stage 3 and train 2 steps; returns the frozen bytes (fp32)."""
    torch.manual_seed(0)
    with zeroshard.zero.Init():
        model = adapted_stack(layers, WIDTH)
    frozen = sum(4 * p._zeroshard_shape.numel() for p in model.parameters() if not p.requires_grad)
    layer = WIDTH * WIDTH
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_max_live_parameters": layer,
                                    "stage3_prefetch_bucket_size": layer}}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=config)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        x = torch.randn(4, WIDTH, generator=g)
        engine.backward(engine(x).square().mean())
        engine.step()
    return frozen


def worker(rank: int, world: int) -> dict[str, int]:
    os.environ.pop("ZEROSHARD_MALLOC_TRIM", None)  # what users get
    _run(1, rank)  # warm-up: code paths and gloo buffers in the baseline
    base = rss.reset_peak()
    frozen = _run(LAYERS, rank)
    now = rss.status()
    return {"peak": now["VmHWM"] - base["VmRSS"], "current": now["VmRSS"] - base["VmRSS"], "frozen": frozen}


def test_lora_under_zero3_holds_a_chunk_of_the_frozen_model() -> None:
    for rank, r in enumerate(run_distributed(worker, 2, timeout=600)):
        frozen = r["frozen"]
        print(f"rank {rank}: peak {r['peak'] / MiB:.0f} MiB, current {r['current'] / MiB:.0f} MiB, "
              f"frozen model {frozen / MiB:.0f} MiB")
        assert r["peak"] <= 0.7 * frozen, f"rank {rank}: peak grew {r['peak'] / MiB:.0f} MiB"
        assert r["current"] <= 0.65 * frozen, f"rank {rank}: {r['current'] / MiB:.0f} MiB held after training"
