"""DeepSpeed's ``deepspeed.utils.logger`` and ``log_dist``, over the ``zeroshard`` logger."""

from __future__ import annotations

import logging

import torch.distributed as dist

__all__ = ["log_dist", "logger"]

#: the ``zeroshard`` logger (DeepSpeed's is named ``DeepSpeed``)
logger = logging.getLogger("zeroshard")


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``[Rank R] message`` on the ranks listed in ``ranks`` (``[-1]``: every rank), as DeepSpeed.

    Without a process group the message is always logged; with one and no ``ranks``, it is not.
    """
    rank = dist.get_rank() if dist.is_initialized() else -1
    should_log = not dist.is_initialized()
    if ranks and not should_log:
        should_log = ranks[0] == -1 or rank in set(ranks)
    if should_log:
        logger.log(level, "[Rank %d] %s", rank, message)
