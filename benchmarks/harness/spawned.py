"""Run a function on a few spawned gloo ranks of this machine and get rank 0's result back.

For the small single-purpose benchmarks (``stage3_order.py``, ``agreement_cost.py``); the main
comparison (``run.py``) starts its workers through ``launch.py`` instead.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable[..., Any], world: int, tmp: str, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("LOCAL_RANK", str(rank))
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    result = fn(rank, world, *args)
    if rank == 0:
        torch.save(result, f"{tmp}/result.pt")
    dist.barrier()
    dist.destroy_process_group()


def run_on_ranks(fn: Callable[..., Any], world: int, *args: Any) -> Any:
    """``fn(rank, world, *args)`` on ``world`` spawned ranks (``fn`` at module level); rank 0's
    return value (plain data and tensors)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(fn, world, tmp, args), nprocs=world, start_method="spawn")
        return torch.load(f"{tmp}/result.pt", weights_only=True)


def demo_gpt_step(engine: Any) -> float:
    """One optimizer step of the demo GPT (2 micro-steps of 4 × 64 random byte tokens) in seconds,
    between barriers: the step the small cost benchmarks time with a feature on and off."""
    dist.barrier()
    t = time.perf_counter()
    for _ in range(2):
        idx = torch.randint(0, 256, (4, 65))
        loss = engine(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
        engine.backward(loss)
        engine.step()
    dist.barrier()
    return time.perf_counter() - t
