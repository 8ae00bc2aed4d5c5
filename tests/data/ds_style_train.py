"""A training script written for DeepSpeed; only its import line differs (``import deepspeed``).

It uses what DeepSpeed scripts use: ``add_config_arguments`` and ``--local_rank`` on the command line,
``deepspeed.init_distributed()``, ``deepspeed.comm`` (ranks, ``all_reduce`` with ``group=``),
``deepspeed.accelerator.get_accelerator()``, ``engine.no_sync()`` for hand-made gradient
accumulation, ``engine.step(lr_kwargs=...)``, ``engine.was_step_applied()``, the config accessors and
``save_checkpoint``'s return value. ``tests/distributed/test_ds_script.py`` runs it under
``zeroshard launch`` with two processes and checks the weights against plain PyTorch.

    zeroshard launch --nproc_per_node 2 tests/data/ds_style_train.py --deepspeed_config CFG --out DIR
"""

import argparse
import atexit
import json
import os
from pathlib import Path

import torch

import zeroshard as deepspeed  # the only change: was "import deepspeed"


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def batches(step: int, rank: int, world: int, half: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s two halves of global batch ``step`` (``2 * half * world`` samples)."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(2 * half * world, 16, generator=g)
    y = torch.randint(0, 4, (2 * half * world,), generator=g)
    return [(x[(m * world + rank) * half:][:half], y[(m * world + rank) * half:][:half]) for m in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description="DeepSpeed-style training")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the DeepSpeed launcher")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    # Runs after zeroshard's own exit handler (registered later, so run earlier): the script never
    # destroys its process group, as DeepSpeed scripts seldom do; zeroshard must have.
    atexit.register(lambda: Path(args.out, f"exit{os.environ['RANK']}.txt").write_text(
        "initialized" if torch.distributed.is_initialized() else "destroyed"))
    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    device = deepspeed.accelerator.get_accelerator().device_name()
    model = build_model()
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    assert engine.zero_optimization_stage() < 2, "no_sync() needs ZeRO stage 0 or 1"
    half = engine.train_micro_batch_size_per_gpu() // 2
    losses, applied = [], []
    for step in range(args.steps):
        (xa, ya), (xb, yb) = batches(step, rank, world, half)
        with engine.no_sync():  # first half: gradients stay local
            loss_a = torch.nn.functional.cross_entropy(engine(xa.to(device)), ya.to(device)) / 2
            engine.backward(loss_a)
        loss_b = torch.nn.functional.cross_entropy(engine(xb.to(device)), yb.to(device)) / 2
        engine.backward(loss_b)
        engine.step(lr_kwargs={"last_batch_iteration": step})
        applied.append(engine.was_step_applied())
        total = (loss_a + loss_b).detach().reshape(1)
        deepspeed.comm.all_reduce(total, group=None)
        losses.append(total.item() / world)
    saved = engine.save_checkpoint(os.path.join(args.out, "ckpt"))
    record = {"rank": rank, "world": world, "local_rank_arg": args.local_rank,
              "local_rank_env": deepspeed.comm.get_local_rank(), "losses": losses, "applied": applied,
              "saved": saved, "lr": engine.get_lr(), "gradient_clipping": engine.gradient_clipping(),
              "params": [p.detach().float().reshape(-1).tolist() for p in engine.module.parameters()]}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
