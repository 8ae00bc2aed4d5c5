"""Process groups and collectives (no global state: groups are passed explicitly)."""

from zeroshard.comm.collectives import (
    all_gather,
    all_reduce,
    broadcast,
    check_same_across_ranks,
    rank,
    reduce_scatter,
    world_size,
)
from zeroshard.comm.groups import init_distributed

__all__ = [
    "all_gather",
    "all_reduce",
    "broadcast",
    "check_same_across_ranks",
    "init_distributed",
    "rank",
    "reduce_scatter",
    "world_size",
]
