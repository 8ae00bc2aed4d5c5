"""Trained by torchrun on the emulated two-node cluster (``tests/distributed/test_emulated_cluster.py``):
an MLP of 4 x 256 x 256 at ZeRO stage 3, fp32, plain or with ZeRO++ (``--quantized``:
``zero_quantized_weights``, ``zero_quantized_gradients`` and ``zero_hpz_partition_size`` 2). A live
budget of one layer releases every unit after its forward, so backward gathers again (hpZ's
case). Rank 0 writes the final loss and the comms logger's bytes by level to ``--out``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

import zeroshard
from zeroshard.core.comm import collectives as C


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quantized", action="store_true")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(256, 256), nn.Tanh())))
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_max_live_parameters": 256 * 257, "stage3_prefetch_bucket_size": 256 * 257,
                                 "zero_quantized_weights": a.quantized, "zero_quantized_gradients": a.quantized,
                                 "zero_hpz_partition_size": 2 if a.quantized else 1},
           "comms_logger": {"enabled": True, "prof_all": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(engine.global_rank)
    loss = torch.zeros(())
    for _ in range(a.steps):
        x = torch.randn(8, 256, generator=g)
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
    levels = dict(C.HOOK.recorder.bytes_by_level)  # type: ignore[union-attr]
    if engine.global_rank == 0:
        (a.out / "train.json").write_text(json.dumps({"loss": float(loss), "levels": levels}))
    engine.destroy()


if __name__ == "__main__":
    main()
