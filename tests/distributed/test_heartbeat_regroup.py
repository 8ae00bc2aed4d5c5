"""The failure-diagnosis heartbeat follows a process group created again in the same process.

A sweep of trainings in one process may end each with ``destroy_process_group()`` and start the
next with a new group. The heartbeat thread of the old group only notices at its next wake-up
(every second), so an ``initialize`` within that second found it alive and kept it, writing to the
destroyed group's store: every other trial, a failed collective could not name the dead or stuck peer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.harness import run_distributed


def regroup_worker(rank: int, world: int, workdir: str) -> list[bool]:
    import zeroshard
    from zeroshard.core.comm import watchdog

    follows = []
    for trial in range(3):
        model = torch.nn.Linear(6, 3)
        engine, *_ = zeroshard.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        engine.backward(engine(torch.randn(2, 6)).sum())
        engine.step()
        hb = watchdog._heartbeat
        follows.append(hb is not None and hb.alive() and hb.store is dist.distributed_c10d._get_default_store())
        engine.destroy()
        dist.barrier()
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"file://{workdir}/regroup{trial}", rank=rank, world_size=world)
    return follows


def test_heartbeat_follows_a_new_process_group(tmp_path) -> None:
    for follows in run_distributed(regroup_worker, 2, str(tmp_path)):
        assert follows == [True, True, True]
