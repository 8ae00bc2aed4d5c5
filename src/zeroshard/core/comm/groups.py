"""Process-group set-up: torchrun's environment, or a single process with none.

``init_distributed`` picks NCCL when CUDA is present and gloo otherwise, honours a group the
user created first, and makes a plain ``python train.py`` a world of one. A group it creates is
destroyed when the interpreter exits, unless the script did so itself.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from zeroshard.errors import DistributedError

logger = logging.getLogger("zeroshard")

#: The default collective timeout (config ``collective_timeout``): torch's 30 minutes is far too long
#: to find out that a job hangs; 10 leaves room for a large checkpoint written while others wait.
DEFAULT_TIMEOUT = timedelta(minutes=10)
_destroy_registered = False
_ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def default_backend() -> str:
    """NCCL on CUDA machines, gloo elsewhere."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def local_rank() -> int:
    """``LOCAL_RANK`` from the launcher's environment (0 without one)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def _destroy_at_exit() -> None:
    """Destroy the process group while the interpreter is still whole, after a clean end.

    DeepSpeed scripts seldom call ``destroy_process_group``; left to the interpreter's teardown,
    gloo's worker threads can be destroyed unjoined and the process dies with SIGABRT ("terminate
    called without an active exception") after training finished (CI, 2 ranks; torch's own tests
    hit it, pytorch/pytorch#65231). After an uncaught exception (``sys.last_value``) the group is
    left alone: destroying it waits for collectives that peers may never finish.
    """
    if dist.is_initialized() and getattr(sys, "last_value", None) is None:
        try:
            dist.destroy_process_group()
        except Exception as err:  # the job is over; exiting must not fail because of it
            logger.debug("destroying the process group at exit failed: %s", err)


def _destroy_when_exiting() -> None:
    # Registered before the heartbeat's and the comms summary's handlers, so it runs after them
    # (atexit runs last-registered first): both still use the group. Once per process.
    global _destroy_registered
    if not _destroy_registered:
        atexit.register(_destroy_at_exit)
        _destroy_registered = True


def init_distributed(
    dist_backend: str | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
    init_method: str | None = None,
    rank: int = -1,
    world_size: int = -1,
    **_deepspeed_only: object,
) -> None:
    """Initialize ``torch.distributed`` the way DeepSpeed's ``init_distributed`` does.

    Reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
    ``LOCAL_RANK``). Without that environment and without ``init_method`` the process is a world
    of one. A process group that already exists is used as it is.

    Args:
        dist_backend: ``"nccl"``, ``"gloo"``, ...; default NCCL with CUDA, else gloo.
        timeout: collective timeout passed to the process group.
        init_method: explicit rendezvous URL (``tcp://``, ``file://``); default ``env://``.
        rank: explicit rank (with ``world_size`` and ``init_method``).
        world_size: explicit world size.
        **_deepspeed_only: DeepSpeed-only arguments (``auto_mpi_discovery``, ``verbose``, ...),
            accepted so DeepSpeed scripts run; they have no meaning here.
    """
    if dist.is_initialized():
        logger.debug("torch.distributed already initialized: using the existing process group")
        return
    backend = dist_backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
        # Small control messages (shape checks, the agreement check, checkpoint coordination) are
        # CPU tensors; NCCL moves only CUDA tensors, so CPU ones go through gloo.
        backend = "cpu:gloo,cuda:nccl"
    env_present = all(k in os.environ for k in _ENV_KEYS)
    if init_method is None and not env_present:
        if world_size not in (-1, 1):
            raise DistributedError(
                f"init_distributed(world_size={world_size}) needs torchrun's environment "
                f"({', '.join(_ENV_KEYS)}) or an init_method; launch with `zeroshard launch`"
            )
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        _destroy_when_exiting()
        return
    kwargs: dict[str, object] = {"timeout": timeout, "init_method": init_method or "env://"}
    if rank >= 0:
        kwargs["rank"] = rank
    if world_size > 0:
        kwargs["world_size"] = world_size
    dist.init_process_group(backend, **kwargs)  # type: ignore[arg-type]
    _destroy_when_exiting()
    logger.info("initialized %s process group: rank %d of %d", backend, dist.get_rank(), dist.get_world_size())
