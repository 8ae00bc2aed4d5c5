"""Process groups and collectives (groups are passed explicitly; see subset.py for the fail-fast guards)."""

from zeroshard.comm.collectives import (
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    check_same_across_ranks,
    rank,
    reduce_scatter,
    world_size,
)
from zeroshard.comm.groups import init_distributed
from zeroshard.comm.subset import on_ranks, set_arrival_timeout

__all__ = [
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "check_same_across_ranks",
    "init_distributed",
    "on_ranks",
    "rank",
    "reduce_scatter",
    "set_arrival_timeout",
    "world_size",
]
