"""zeroshard's own residency per rank: model states, communication buffers, ZeRO-3 gathered units.

The model-state part predicts ``engine.memory_usage()`` key by key (Ψ parameters, N ranks,
``c`` the compute dtype's bytes, ``a`` the gradient-accumulation dtype's, Adam's two fp32
moments; shards are padded per parameter to a multiple of N, as :mod:`zeroshard.core.partition` lays
them out):

====================  ==========  ==========  ==========  =========================
key                   stage 0     stage 1     stage 2     stage 3
====================  ==========  ==========  ==========  =========================
``parameters``        cΨ          cΨ          cΨ          c·(persistent units)
``gradients``         aΨ          aΨ          aΨ/N        aΨ/N
``master_weights``    4Ψ (16-bit) 4Ψ/N        4Ψ/N        4Ψ/N
``optimizer_states``  8Ψ          8Ψ/N        8Ψ/N        8Ψ/N
====================  ==========  ==========  ==========  =========================

In fp32 training the masters at stages 0–2 are the module's parameters (0 bytes). Stage 3 keeps no
compute-dtype parameter shard: units are gathered from the fp32 master shard, cast on the way
(:mod:`zeroshard.estimate.residency` has the offload cases, where one is kept). Stage 1's gradient
accumulator holds every rank's padded rows (N·⌈Ψ/N⌉ per parameter). Beyond the model state, a rank holds reused
communication buffers (stages 2–3: up to 3 reduce buckets in the accumulation dtype; stages 1–2
with N > 1: 2 all-gather buffer pairs in the compute dtype) and, at ZeRO-3, gathered units: up
to ``stage3_max_live_parameters`` plus the prefetch and the units in use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zeroshard.core.partition import COMM_BUFFERS, ShardLayout, buffer_numel, consecutive_runs
from zeroshard.estimate.model_spec import ModelSpec

__all__ = ["DTYPE_BYTES", "Buckets", "StateEstimate", "model_states"]

#: bytes per element of the dtype names the config uses
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

#: DeepSpeed's (and zeroshard's) default of ``stage3_param_persistence_threshold``
PERSISTENCE_THRESHOLD = 100_000

@dataclass(frozen=True)
class Buckets:
    """The communication and ZeRO-3 budgets of a config (DeepSpeed's defaults)."""

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    max_live_parameters: int = 1_000_000_000
    prefetch_bucket_size: int = 50_000_000

    def config(self, stage: int) -> dict[str, int]:
        """The ``zero_optimization`` keys for these sizes at ``stage``."""
        out = {"reduce_bucket_size": self.reduce_bucket_size}
        if stage in (1, 2):
            out["allgather_bucket_size"] = self.allgather_bucket_size
        if stage == 3:
            out["stage3_max_live_parameters"] = self.max_live_parameters
            out["stage3_prefetch_bucket_size"] = self.prefetch_bucket_size
        return out


@dataclass(frozen=True)
class StateEstimate:
    """Bytes per rank: ``breakdown`` as ``memory_usage()`` reports it, plus working buffers."""

    breakdown: dict[str, int]
    workspace: int
    gathered: int
    notes: list[str] = field(default_factory=list)
    #: ZeRO++ hpZ's secondary shards over a pass (``zero_hpz_partition_size`` > 1)
    secondary: int = 0

    @property
    def total(self) -> int:
        """Model state: what ``memory_usage()["total"]`` reports."""
        return self.breakdown["total"]

    @property
    def buffers(self) -> int:
        """Communication workspace plus ZeRO-3 gathered parameters (and hpZ's secondary shards)."""
        return self.workspace + self.gathered + self.secondary


def _padded(numels: tuple[int, ...] | None, total: int, world: int) -> int:
    """Elements of one rank's padded shard of every parameter."""
    if numels is None:
        return ShardLayout(total, world).shard_numel
    return sum(ShardLayout(n, world).shard_numel for n in numels)


def unit_rows(spec: ModelSpec, world: int) -> list[int]:
    """Per-rank row of each ZeRO-3 unit (its parameters' padded chunks), in registration order.

    Without per-parameter sizes each unit counts as one parameter; a bare count is cut into
    units of the largest layer.
    """
    if spec.units is not None and spec.unit_param_counts is not None and spec.param_numels is not None:
        rows, i = [], 0
        for k in spec.unit_param_counts:
            rows.append(sum(ShardLayout(n, world).shard_numel for n in spec.param_numels[i : i + k]))
            i += k
        return rows
    if spec.units is not None:
        return [ShardLayout(u, world).shard_numel for u in spec.units]
    total, big = int(spec.total_params), max(1, int(spec.largest_layer_params))
    return [ShardLayout(min(big, total - s), world).shard_numel for s in range(0, total, big)]


def _largest_run(sizes: list[int] | None, total: int, limit: int) -> tuple[int, int]:
    """``(largest run, number of runs)`` of consecutive sizes grouped up to ``limit``; with the
    sizes unknown (a bare count), parameters are assumed small next to ``limit``."""
    if sizes is None:
        return min(total, limit), -(-total // limit)
    runs = consecutive_runs(sizes, lambda n: n, limit)
    return max(sum(r) for r in runs), len(runs)


def model_states(spec: ModelSpec, stage: int, world: int, dtype: str = "bf16", grad_accum_dtype: str = "fp32",
                 buckets: Buckets | None = None,
                 persistence_threshold: int = PERSISTENCE_THRESHOLD, hpz_partition_size: int = 1) -> StateEstimate:
    """zeroshard's bytes per rank for ``spec`` trained with Adam at ``stage`` on ``world`` ranks.

    Args:
        spec: the model.
        stage: ZeRO stage, 0–3.
        world: data-parallel ranks (GPUs in all nodes).
        dtype: compute dtype, ``"bf16"``, ``"fp16"`` or ``"fp32"``.
        grad_accum_dtype: ``data_types.grad_accum_dtype`` (zeroshard's default ``"fp32"``).
        buckets: bucket sizes and ZeRO-3 budgets (DeepSpeed's defaults when ``None``).
        persistence_threshold: ``stage3_param_persistence_threshold``.
        hpz_partition_size: ZeRO++ hpZ's ``zero_hpz_partition_size``: at stage 3 each rank keeps
            ``1/h`` of every gathered unit that is not persistent, from its forward to the end of
            its backward (:mod:`zeroshard.core.zero3.secondary`).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0-3, got {stage}")
    buckets = buckets or Buckets()
    c, a = DTYPE_BYTES[dtype], DTYPE_BYTES[grad_accum_dtype]
    psi = spec.total_params
    mixed = c != 4
    shard = psi if stage == 0 else _padded(spec.param_numels, psi, world)
    persistent = sum(u for u in spec.units or () if u <= persistence_threshold) if stage == 3 else 0
    out: dict[str, int] = {"parameters": c * (persistent if stage == 3 else psi)}
    out["gradients"] = a * (shard if stage >= 2 else shard * world if stage == 1 else psi)
    out["master_weights"] = 4 * shard if (mixed or stage == 3) else 0
    out["optimizer_states"] = 8 * shard
    out["total"] = sum(out.values())

    # Communication buffers, grouped as the stages group parameters (reverse registration order).
    # ZeRO-3 reduces runs of units, each padded parameter by parameter as the engine lays them out.
    padded: list[int] | None = None
    if stage == 3 and spec.units is not None:
        padded = [row * world for row in unit_rows(spec, world)]
    elif stage < 3 and spec.param_numels is not None:
        padded = [ShardLayout(n, world).shard_numel * world for n in reversed(spec.param_numels)]
    workspace = 0
    if stage >= 2:
        largest, count = _largest_run(padded, psi, buffer_numel(buckets.reduce_bucket_size))
        workspace += min(COMM_BUFFERS, count) * largest * a
    if stage in (1, 2) and world > 1:
        # Gathered in place: the buffers are the outputs, this rank's row packed into them.
        largest, count = _largest_run(padded, psi, buffer_numel(buckets.allgather_bucket_size))
        workspace += min(COMM_BUFFERS, count) * largest * c
    gathered = secondary = 0
    if stage == 3:
        gatherable = sum(u for u in spec.units if u > persistence_threshold) if spec.units else psi
        biggest = max(spec.units) if spec.units else spec.largest_layer_params
        gathered = c * min(gatherable, buckets.max_live_parameters + buckets.prefetch_bucket_size + biggest)
        if hpz_partition_size > 1:  # 1/h of each released unit's padded rows
            rows = ([r * world for r, u in zip(unit_rows(spec, world), spec.units) if u > persistence_threshold]
                    if spec.units else [gatherable])
            secondary = c * sum(rows) // hpz_partition_size
    return StateEstimate(breakdown=out, workspace=workspace, gathered=gathered, secondary=secondary)
