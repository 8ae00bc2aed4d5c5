"""A training script for fault injection, run by ``zeroshard launch`` (see ``tests/faults.py``).

``ZEROSHARD_TEST_FAULT=rank:step:point:kind`` makes that rank SIGKILL (``kill``) or SIGSTOP
(``stop``) itself at ``point`` (``forward``, ``backward``, ``step`` or ``save``) of that optimizer
step, on the first attempt only (a restarted job runs clean). The config resumes automatically
from ``--ckpt`` (``checkpoint.auto_resume``) and saves there every ``--save-every`` steps; rank 0
writes the final parameters to ``--out`` (safetensors).
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

import zeroshard

GA, MICRO = 2, 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    fault = os.environ.get("ZEROSHARD_TEST_FAULT", "")
    first_attempt = os.environ.get("ZEROSHARD_LAUNCH_ATTEMPT", "0") == "0" and \
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    rank = int(os.environ["RANK"])

    def maybe_fault(point: str, step: int) -> None:
        if not fault or not first_attempt:
            return
        f_rank, f_step, f_point, kind = fault.split(":")
        if (int(f_rank), int(f_step), f_point) == (rank, step, point):
            os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 37), nn.Tanh(), nn.Linear(37, 37), nn.Tanh(), nn.Linear(37, 5))
    config = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "collective_timeout": args.timeout,
        "checkpoint": {"auto_resume": args.ckpt},
    }
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(engine.global_steps, args.steps):
        for m in range(GA):
            g = torch.Generator().manual_seed(1000 * step + 10 * m + rank)
            x, y = torch.randn(MICRO, 13, generator=g), torch.randn(MICRO, 5, generator=g)
            maybe_fault("forward", step)
            loss = F.mse_loss(engine(x), y)
            maybe_fault("backward", step)
            engine.backward(loss)
            maybe_fault("step", step)
            engine.step()
        if (step + 1) % args.save_every == 0:
            maybe_fault("save", step)
            engine.save_checkpoint(args.ckpt)
    with engine.gathered():
        params = {n: p.detach().clone().contiguous() for n, p in engine.module.named_parameters()}
    if rank == 0:
        save_file(params, args.out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    Path(f"{args.out}.rank{rank}.done").touch()  # the last statement: see tests/teardown.py


if __name__ == "__main__":
    main()
