"""Shard geometry shared by the stages, checkpoints and estimator."""

from zeroshard.partition.layout import Bucket, ShardLayout, gather_from_rows, make_buckets, scatter_into_rows

__all__ = ["Bucket", "ShardLayout", "gather_from_rows", "make_buckets", "scatter_into_rows"]
