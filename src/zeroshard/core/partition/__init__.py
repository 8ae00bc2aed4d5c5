"""Shard geometry shared by the stages, checkpoints and estimator."""

from zeroshard.core.partition.layout import (
    COMM_BUFFERS,
    INIT_CHUNK_ATTR,
    SHAPE_ATTR,
    Bucket,
    ShardLayout,
    buckets_from_groups,
    buffer_numel,
    consecutive_runs,
    full_numel,
    full_shape,
    gather_from_rows,
    make_buckets,
    merge_buckets,
    scatter_into_rows,
    set_full_shape,
)

__all__ = [
    "COMM_BUFFERS",
    "INIT_CHUNK_ATTR",
    "SHAPE_ATTR",
    "Bucket",
    "ShardLayout",
    "buffer_numel",
    "buckets_from_groups",
    "consecutive_runs",
    "full_numel",
    "full_shape",
    "gather_from_rows",
    "make_buckets",
    "merge_buckets",
    "scatter_into_rows",
    "set_full_shape",
]
