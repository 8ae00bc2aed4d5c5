"""A DeepSpeed-style training script for ``tests/distributed/test_multinode.py``.

It declares ``--local_rank`` as DeepSpeed scripts do (required here, so a launcher that does not
pass it fails the run) and checks it against ``LOCAL_RANK``. It trains a small MLP with ZeRO-2 for
a few steps on a global batch that does not depend on how ranks are spread over nodes; rank 0
writes the final parameters to ``--out`` (safetensors); every rank writes ``<out>.rank<R>.json``
with where it ran (torchrun's ``GROUP_RANK`` is the node rank).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

import zeroshard as deepspeed

MICRO = 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--local_rank", type=int, required=True, help="passed by the launcher, as DeepSpeed does")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    if args.local_rank != int(os.environ["LOCAL_RANK"]):
        raise SystemExit(f"--local_rank={args.local_rank} but LOCAL_RANK={os.environ['LOCAL_RANK']}")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 37), nn.Tanh(), nn.Linear(37, 5))
    config = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(MICRO * world, 13, generator=g), torch.randn(MICRO * world, 5, generator=g)
        mine = slice(rank * MICRO, (rank + 1) * MICRO)
        loss = F.mse_loss(engine(x[mine]), y[mine])
        engine.backward(loss)
        engine.step()
    with engine.gathered():
        params = {n: p.detach().clone().contiguous() for n, p in engine.module.named_parameters()}
    record = {
        "rank": rank, "world_size": world, "local_rank_arg": args.local_rank,
        "env": {k: os.environ.get(k) for k in ("GROUP_RANK", "LOCAL_RANK", "ZS_TEST_MARK", "CUDA_VISIBLE_DEVICES")},
    }
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(record))
    if rank == 0:
        save_file(params, args.out)
    dist.barrier()
    dist.destroy_process_group()
    Path(f"{args.out}.rank{rank}.done").touch()  # the last statement: see tests/teardown.py


if __name__ == "__main__":
    main()
