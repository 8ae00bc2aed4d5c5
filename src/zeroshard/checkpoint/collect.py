"""What a checkpoint reads from (and writes back into) a live engine, in one place.

The stages expose the fp32 master of each trained parameter as a 1-D view of the elements
``[lo, hi)`` of its flattened values (``optimizer.master.views``), with the geometry in the
buckets' :class:`~zeroshard.core.partition.ShardLayout`. This module turns that into
:class:`TrainedParam` records (name, global shape, range, param group) and classifies optimizer
state, so save and load never touch stage internals beyond these few attributes.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from zeroshard.core.partition import ShardLayout, full_shape
from zeroshard.core.seam import the_unit, unit_of
from zeroshard.errors import CheckpointError

SHARDED, SCALAR, NUMBER = "sharded", "scalar", "number"
#: Param-group keys that choose an implementation rather than the math; a resume keeps the live ones.
IMPLEMENTATION_KEYS = frozenset({"params", "param_names", "fused", "foreach", "capturable", "differentiable"})


@dataclass
class StoredParam:
    """A parameter a checkpoint stores in pieces: this rank holds its elements ``[lo, hi)`` of a
    layout over ``layout_world`` ranks (1: every rank holds it whole)."""

    name: str
    param: torch.nn.Parameter
    shape: tuple[int, ...]
    numel: int
    lo: int
    hi: int
    layout_world: int

    def save_range(self, rank: int, world: int) -> tuple[int, int]:
        """Elements this rank writes: its own chunk, or (when every rank holds everything, as at
        stage 0) its chunk of an even split, so that ranks write in parallel."""
        if self.layout_world == 1:
            return ShardLayout(self.numel, world).local_range(rank)
        return self.lo, self.hi

    def pieces(self, world: int) -> list[tuple[int, int, int]]:
        """``(rank, start, end)`` of every non-empty piece the ``world`` ranks write."""
        layout = ShardLayout(self.numel, world if self.layout_world == 1 else self.layout_world)
        out = [(r, *layout.local_range(r)) for r in range(layout.world)]
        return [(r, s, e) for r, s, e in out if e > s]


@dataclass
class TrainedParam(StoredParam):
    """A trained parameter and this rank's fp32 master of its elements ``[lo, hi)``."""

    master: torch.nn.Parameter = None  # type: ignore[assignment]
    group: int = 0


@dataclass
class FrozenParam(StoredParam):
    """A parameter that is not trained, in its compute dtype: whole on every rank, or (ZeRO-3)
    this rank's chunk in the frozen shard (``owner``)."""

    owner: Any = None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype its pieces are stored in."""
        return self.owner.dtype if self.owner is not None else self.param.dtype  # type: ignore[no-any-return]

    def values(self, s: int, e: int) -> torch.Tensor:
        """Elements ``[s, e)`` (within what this rank holds)."""
        if self.owner is None:
            return self.param.detach().reshape(-1)[s:e]
        return self.owner.read(self.param)[s - self.lo : e - self.lo]  # type: ignore[no-any-return]


def _global_shape(p: torch.nn.Parameter, numel: int) -> tuple[int, ...]:
    # Stage 3 keeps shapes on the parameter's unit, asked first: a released parameter's placeholder
    # has as many elements (none) as a full one of shape (11, 0), but not its shape.
    unit = unit_of(p)
    if unit is not None:
        for q, shape in zip(unit.params, unit.shapes):
            if q is p:
                return tuple(shape)
    if p.numel() == numel:
        return tuple(p.shape)
    raise CheckpointError(f"cannot tell the full shape of a partitioned parameter ({numel} elements)")


def trained_params(engine: Any) -> list[TrainedParam]:
    """Every trained parameter of ``engine``, in ``module.named_parameters()`` order."""
    zopt = engine.optimizer
    rank = zopt.master.rank
    group_of = {id(m): g for g, grp in enumerate(zopt.optimizer.param_groups) for m in grp["params"]}
    by_param = {}
    for bucket in zopt.buckets:
        for p, layout in zip(bucket.params, bucket.layouts):
            lo, hi = layout.local_range(rank)
            master = zopt.master.views[p]
            if master.numel() != hi - lo:
                raise CheckpointError("master view and shard layout disagree; checkpoint cannot be made")
            by_param[id(p)] = (p, master, layout, lo, hi)
    out = []
    for name, p in engine.module.named_parameters():
        if id(p) not in by_param:
            continue
        p, master, layout, lo, hi = by_param[id(p)]
        out.append(TrainedParam(name, p, _global_shape(p, layout.numel), layout.numel, lo, hi, layout.world,
                                master=master, group=group_of.get(id(master), 0)))
    return out


def frozen_params(engine: Any, trained: list[TrainedParam]) -> list[FrozenParam]:
    """Every parameter of ``engine.module`` that is not trained, in ``named_parameters()`` order.
    ZeRO-3 partitions them (this rank's chunk); other stages hold them whole."""
    shard = getattr(engine.optimizer, "frozen", None)
    trained_ids = {id(t.param) for t in trained}
    out = []
    for name, p in engine.module.named_parameters():
        if id(p) in trained_ids:
            continue
        if shard is not None and p in shard.ranges:
            lo, hi = shard.ranges[p]
            unit = the_unit(p)
            layout = unit.bucket.layouts[unit.position(p)]
            out.append(FrozenParam(name, p, tuple(full_shape(p)), layout.numel, lo, hi, layout.world, owner=shard))
        else:
            out.append(FrozenParam(name, p, tuple(p.shape), p.numel(), 0, p.numel(), 1))
    return out


def state_kinds(state: dict[str, Any], master: torch.Tensor, name: str) -> dict[str, str]:
    """Classify each optimizer-state entry of one parameter as sharded, scalar or number."""
    kinds = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.shape == master.shape:
            kinds[key] = SHARDED
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            kinds[key] = SCALAR
        elif isinstance(value, (bool, int, float)):
            kinds[key] = NUMBER
        else:
            what = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise CheckpointError(
                f"optimizer state {key!r} of parameter {name!r} is a {what}: neither the parameter's shape "
                "nor a scalar, so it cannot be resharded (only elementwise optimizers are supported)"
            )
    return kinds


def state_piece(value: Any, kind: str, lo: int, s: int, e: int) -> torch.Tensor:
    """The stored form of one state entry for the piece ``[s, e)`` of a master holding ``[lo, ...)``."""
    if kind == SHARDED:
        return value.detach()[s - lo : e - lo]
    if kind == SCALAR:
        return value.detach().reshape(())
    return torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else torch.int64)


def module_state(engine: Any) -> dict[str, Any]:
    """``engine.module.state_dict(keep_vars=True)`` without any collective, so that any subset of
    ranks may call it: ZeRO-3's partitioned parameters are left as their empty placeholders. Read
    only the keys, the buffers and the parameters that are not trained (never partitioned)."""
    coordinator = engine.optimizer.coordinator
    with coordinator.placeholders() if coordinator is not None else nullcontext():
        return engine.module.state_dict(keep_vars=True)  # type: ignore[no-any-return]


def module_layout(engine: Any) -> dict[str, Any]:
    """Names the checkpoint records about ``engine.module`` besides the trained parameters.

    Returns ``module_keys`` (``state_dict()`` order), ``aliases`` (tied names -> first name),
    and ``buffers`` (name -> tensor, persistent buffers; the parameters that are not trained are
    :func:`frozen_params`). Gathers nothing (rank 0 alone calls it).
    """
    module = engine.module
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[n] = first[id(p)]
        else:
            first[id(p)] = n
    state = module_state(engine)
    names = set(first.values()) | set(aliases)
    buffers = {k: v.detach() for k, v in state.items() if k not in names and isinstance(v, torch.Tensor)}
    return {"module_keys": list(state), "aliases": aliases, "buffers": buffers}


def group_options(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's options (hyperparameters and implementation flags, no params)."""
    return [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in optimizer.param_groups]
