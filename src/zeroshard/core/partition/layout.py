"""Pure shard arithmetic: how a flattened parameter is split into equal, padded chunks.

Every parameter is flattened and cut into ``world`` chunks of ``ceil(numel / world)`` elements;
chunk ``r`` belongs to rank ``r``. The last ranks' chunks may be partly or wholly padding, which is
never dropped and never stored in a checkpoint (each rank's *real* elements are
``local_range(rank)``). Parameters that communicate together form a :class:`Bucket`; inside a
bucket the flat buffer is laid out ``[world, bucket.numel]`` so that row ``r`` is rank ``r``'s
chunks of every parameter in the bucket, back to back. That layout makes one
``reduce_scatter_tensor`` / ``all_gather_into_tensor`` move a whole bucket.

No torch collectives here and no state: this module is the geometry the stages, checkpoints and
the memory estimator all share.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

_T = TypeVar("_T")

#: Attribute holding a parameter's real shape while its ``.data`` is an empty placeholder
#: (ZeRO-3 at rest, or built under ``zero.Init``).
SHAPE_ATTR = "_zeroshard_shape"
#: Attribute holding this rank's chunk of a parameter built under ``zero.Init`` until adopted.
INIT_CHUNK_ATTR = "_zeroshard_init_chunk"


def full_shape(p: torch.Tensor) -> torch.Size:
    """A parameter's real shape, also while its data is a placeholder."""
    return torch.Size(getattr(p, SHAPE_ATTR, p.shape))


def set_full_shape(p: torch.Tensor, shape: torch.Size) -> None:
    """Record a parameter's real shape before its data becomes a placeholder (read by :func:`full_shape`)."""
    setattr(p, SHAPE_ATTR, torch.Size(shape))


def full_numel(p: torch.Tensor) -> int:
    """A parameter's real element count, also while its data is a placeholder."""
    return int(full_shape(p).numel())


@dataclass(frozen=True)
class ShardLayout:
    """Geometry of one flattened tensor split over ``world`` ranks."""

    numel: int
    world: int

    @property
    def shard_numel(self) -> int:
        """Padded chunk size: every rank's chunk has this many slots."""
        return -(-self.numel // self.world)

    def local_range(self, rank: int) -> tuple[int, int]:
        """Half-open range of real (unpadded) elements of the flat tensor owned by ``rank``."""
        start = min(rank * self.shard_numel, self.numel)
        end = min(start + self.shard_numel, self.numel)
        return start, end

    def local_numel(self, rank: int) -> int:
        """Number of real elements owned by ``rank`` (0 for a rank holding only padding)."""
        start, end = self.local_range(rank)
        return end - start


@dataclass
class Bucket:
    """Parameters that are reduced (and gathered) by one collective.

    Attributes:
        index: position in launch order; every rank launches buckets in this order.
        params: the parameters, in layout order.
        layouts: one :class:`ShardLayout` per parameter.
        offsets: column of each parameter's chunk inside a row of the bucket.
        numel: row length (sum of the parameters' padded chunk sizes).
        start: offset of this bucket's row inside the rank-local flat shard buffer.
    """

    index: int
    params: list[torch.nn.Parameter]
    layouts: list[ShardLayout]
    offsets: list[int]
    numel: int
    start: int = 0
    ready: set[int] = field(default_factory=set)

    @property
    def full_numel(self) -> int:
        """Elements of the full (all ranks) bucket buffer."""
        return self.numel * (self.layouts[0].world if self.layouts else 1)


def consecutive_runs(items: Sequence[_T], size: Callable[[_T], int], max_size: int) -> list[list[_T]]:
    """Split ``items``, in order, into runs of at most ``max_size`` in total (at least one item each).

    The one greedy grouping behind buckets, merged buckets, all-gather groups and broadcasts.
    """
    runs: list[list[_T]] = []
    total = 0
    for item in items:
        n = size(item)
        if not runs or total + n > max_size:
            runs.append([])
            total = 0
        runs[-1].append(item)
        total += n
    return runs


#: Communication buffers of one kind in use at once (stage 2–3 reduce buffers, stage 1–2
#: all-gather buffers): one fills while the other is in flight, as DeepSpeed's double-buffered
#: ``overlap_comm``. Measured on the 25M GPT with 6.5M-element buckets, a third gave the same
#: step time (0.64-0.67 s) and 25 MiB more peak RSS.
COMM_BUFFERS = 2


def buffer_numel(bucket_size: int) -> int:
    """Full elements per communication buffer for a ``reduce_bucket_size`` or
    ``allgather_bucket_size`` of ``bucket_size``: DeepSpeed's "elements reduced (all-gathered) at
    a time", split over the :data:`COMM_BUFFERS` in flight (DeepSpeed's ``overlap_comm`` keeps two
    of the whole size). Halving the reduce buffers took 26 MiB off the 25M GPT's stage 2 peak at
    the same step time."""
    return max(1, bucket_size // COMM_BUFFERS)


def make_buckets(params: Sequence[torch.nn.Parameter], world: int, max_numel: int) -> list[Bucket]:
    """Group parameters into buckets of at most ``max_numel`` full elements (at least one param each).

    Parameters are taken in the order given; callers pass them in expected gradient-ready order.
    """
    return buckets_from_groups(consecutive_runs(params, full_numel, max_numel), world)


def buckets_from_groups(groups: Sequence[Sequence[torch.nn.Parameter]], world: int) -> list[Bucket]:
    """One bucket per group of parameters, laid out one after another in the rank-local flat buffer."""
    buckets = [_bucket(i, list(g), world) for i, g in enumerate(groups)]
    start = 0
    for b in buckets:
        b.start = start
        start += b.numel
    return buckets


def merge_buckets(buckets: Sequence[Bucket], max_numel: int) -> list[Bucket]:
    """Consecutive buckets joined into larger ones of at most ``max_numel`` full elements (at least
    one bucket each), for one collective where each of them would otherwise need its own.

    Buckets lie back to back in the rank-local flat buffer, so a run of them is itself a bucket:
    its row is their rows side by side, and it starts where the first one does.
    """
    runs = consecutive_runs(buckets, lambda b: b.full_numel, max_numel)
    merged = []
    for index, run in enumerate(runs):
        merged.append(Bucket(
            index=index,
            params=[p for b in run for p in b.params],
            layouts=[lay for b in run for lay in b.layouts],
            offsets=[b.start - run[0].start + off for b in run for off in b.offsets],
            numel=sum(b.numel for b in run),
            start=run[0].start,
        ))
    return merged


def _bucket(index: int, params: list[torch.nn.Parameter], world: int) -> Bucket:
    layouts = [ShardLayout(full_numel(p), world) for p in params]
    offsets, col = [], 0
    for layout in layouts:
        offsets.append(col)
        col += layout.shard_numel
    return Bucket(index=index, params=list(params), layouts=layouts, offsets=offsets, numel=col)


def scatter_into_rows(rows: torch.Tensor, flat: torch.Tensor, accumulate: bool = False, alpha: float = 1.0) -> None:
    """Write (or add) ``alpha * flat`` into its ``[world, shard_numel]`` column block, row-major.

    ``rows`` is a (possibly strided) ``[world, k]`` view; ``flat`` has ``numel <= world * k``.
    Writing also zeroes the padding slots, so a reused (not zero-filled) buffer holds exactly this
    tensor; adding leaves them as they are (zero, since the first write of a window copies).
    """
    k = rows.shape[1]
    n = flat.numel()
    if k == 0:
        return

    def put(dst: torch.Tensor, src: torch.Tensor) -> None:
        if accumulate:
            dst.add_(src, alpha=alpha)
        elif alpha == 1.0:
            dst.copy_(src)
        else:
            torch.mul(src, alpha, out=dst)

    full, rem = divmod(n, k)
    if full:
        put(rows[:full], flat[: full * k].view(full, k))
    if rem:
        put(rows[full, :rem], flat[full * k :])
    if not accumulate and full < rows.shape[0]:
        rows[full, rem:].zero_()
        rows[full + 1 :].zero_()


def gather_from_rows(rows: torch.Tensor, flat: torch.Tensor, skip_row: int | None = None) -> None:
    """Inverse of :func:`scatter_into_rows`: read the real elements of a column block into ``flat``.

    ``skip_row`` leaves that rank's elements of ``flat`` as they are (they already hold them).
    """
    k = rows.shape[1]
    n = flat.numel()
    if k == 0:
        return
    if skip_row is not None:
        gather_from_rows(rows[:skip_row], flat[: min(skip_row * k, n)])
        gather_from_rows(rows[skip_row + 1 :], flat[min((skip_row + 1) * k, n) :])
        return
    full, rem = divmod(n, k)
    if full:
        flat[: full * k].view(full, k).copy_(rows[:full])
    if rem:
        flat[full * k :].copy_(rows[full, :rem])
