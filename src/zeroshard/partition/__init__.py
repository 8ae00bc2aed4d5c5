"""Shard geometry shared by the stages, checkpoints and estimator."""

from zeroshard.partition.layout import (
    Bucket,
    ShardLayout,
    buckets_from_groups,
    gather_from_rows,
    make_buckets,
    scatter_into_rows,
)

__all__ = [
    "Bucket",
    "ShardLayout",
    "buckets_from_groups",
    "gather_from_rows",
    "make_buckets",
    "scatter_into_rows",
]
