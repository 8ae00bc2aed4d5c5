"""A small multi-process test harness: one process per rank, ``file://`` rendezvous, hard deadline.

``run_distributed(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in ``world_size``
new processes (see :data:`START_METHOD`) that share a gloo process group, and returns each rank's return value (tensors,
numbers, strings and plain containers; they travel through ``torch.save``/``torch.load(weights_only)``).
A rank that raises fails the test with its traceback; ranks still alive at the deadline are
killed and the test fails naming them. ``fn`` must be a module-level function.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: How ranks start. "forkserver" (the default) forks each from one server process that imported
#: torch once, about a second less per rank than "spawn" (a fresh interpreter importing torch),
#: over the few hundred jobs of the suite. Each rank still gets the test's environment as it is
#: at the call (below), so both methods run the same code; ``spawn`` is there to check that.
#: ``torch._dynamo`` is preloaded too: ``torch.optim.Optimizer``'s constructor imports it on first
#: use, 1.1-2 s per rank of every job that builds an optimizer (17 s of the 40 s that
#: test_parity.py and test_agreement.py took here).
START_METHOD = os.environ.get("ZEROSHARD_TEST_START_METHOD", "forkserver")
if START_METHOD not in ("forkserver", "spawn"):
    raise ValueError(f"ZEROSHARD_TEST_START_METHOD must be 'forkserver' or 'spawn', got {START_METHOD!r}")
if START_METHOD == "forkserver":
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo"])


def log_lines(level: int = logging.NOTSET) -> list[str]:
    """The messages the ``zeroshard`` logger emits from now on in this process at ``level`` and above,
    as a list that grows (for a rank to return them): the list a handler attached here appends to."""
    lines: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("zeroshard").addHandler(_Keep(level))
    return lines


def _entry(rank: int, fn: Callable[..., Any], world_size: int, workdir: str, args: tuple[Any, ...],
           environ: dict[str, str]) -> None:
    # A forked rank inherits the server's environment, taken when it started: use the test's.
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    os.environ.setdefault("LOCAL_RANK", str(rank))
    dist.init_process_group(
        "gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world_size
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(workdir) / f"result_{rank}.pt")
        # Tear down together: a rank that closes its gloo connections while a peer still uses them
        # can abort the peer ("terminate called without an active exception").
        dist.barrier()
        (Path(workdir) / f"finished_{rank}").touch()
    finally:
        dist.destroy_process_group()


def _teardown_only(error: mp.ProcessExitedException, fn: Callable[..., Any], world_size: int,
                   workdir: Path) -> None:
    """Re-raise ``error`` unless every rank had returned, saved its result and passed the
    teardown barrier before one died by a signal, i.e. in ``destroy_process_group`` or interpreter
    shutdown. A rank aborted there once in a CI run of 762 tests ("terminate called without an
    active exception"; not reproduced in 40 reruns of that test). The results are then whole:
    warn, naming the rank. A death before the barrier still fails the test.
    """
    finished = all((workdir / f"finished_{r}").exists() for r in range(world_size))
    if error.signal_name is None or not finished:
        raise error
    warnings.warn(f"{fn.__name__}: rank {error.error_index} died by {error.signal_name} after the teardown barrier "
                  "(every rank had returned and saved its result)", RuntimeWarning, stacklevel=3)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results."""
    with tempfile.TemporaryDirectory(prefix="zeroshard-test-") as workdir:
        ctx = mp.start_processes(_entry, args=(fn, world_size, workdir, args, dict(os.environ)), nprocs=world_size,
                                 join=False, start_method=START_METHOD)
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    hung = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                    raise TimeoutError(f"{fn.__name__}: ranks {hung} still running after {timeout:.0f}s; killed")
        except mp.ProcessExitedException as e:
            _teardown_only(e, fn, world_size, Path(workdir))
        return [
            torch.load(Path(workdir) / f"result_{r}.pt", weights_only=True) for r in range(world_size)
        ]
