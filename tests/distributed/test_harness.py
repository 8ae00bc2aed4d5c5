"""The test harness forgives exactly one thing: a rank that dies by a signal after every rank has
returned, saved its result and passed the teardown barrier. A death before that fails the test."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness import run_distributed


def _abort() -> None:
    os.kill(os.getpid(), signal.SIGABRT)


def abort_in_teardown(rank: int, world: int) -> torch.Tensor:
    if rank == 1:  # dies in destroy_process_group, after the harness's teardown barrier
        destroy = dist.destroy_process_group

        def destroy_then_abort(*args: object, **kwargs: object) -> None:
            destroy(*args, **kwargs)  # type: ignore[arg-type]
            _abort()

        dist.destroy_process_group = destroy_then_abort
    return torch.tensor([rank])


def abort_while_working(rank: int, world: int) -> torch.Tensor:
    if rank == 1:
        _abort()
    return torch.tensor([rank])


def test_death_in_teardown_keeps_the_results_and_warns() -> None:
    with pytest.warns(RuntimeWarning, match="rank 1 died by SIGABRT after the teardown barrier"):
        results = run_distributed(abort_in_teardown, 2)
    assert [int(r) for r in results] == [0, 1]


def test_death_before_the_barrier_fails() -> None:
    with pytest.raises(mp.ProcessExitedException, match="signal SIGABRT"):
        run_distributed(abort_while_working, 2, timeout=60)
