"""Where zeroshard keeps a rank's training state with offload: bytes by kind and by place.

:func:`placement` predicts ``engine.optimizer.memory_placement()`` (the same kinds and places)
for an :class:`Offload` choice, plus the module's own parameters. It reads the same geometry as
the stages: per-parameter shards padded to a multiple of N, buckets (stages 1–2: runs of
parameters up to ``reduce_bucket_size``; stage 3: one per unit), optimizer sub-groups (runs of
whole buckets up to ``sub_group_size``, chosen from the shard when unset exactly as the engine
chooses it), swap-file regions aligned to 4096 bytes.

Per rank (Ψ parameters, S = this rank's padded shard ≈ Ψ/N, ``c`` compute-dtype bytes, ``a``
gradient-accumulation bytes, Adam), with an accelerator:

- ``parameters`` (the module's): device cΨ; stage 3 only its persistent units.
- ``gradients``: stage 0 device aΨ; stage 1 device a·N·S (every rank's rows, reduce-scattered at
  the boundary, also with offload); stages 2–3 a·S, on the device, or in pinned host memory with
  optimizer offload (the reduced shard accumulates next to the step).
- ``master_weights`` 4S and ``optimizer_states`` 8S: on the device (fp32 at stages 0–2: no master
  bytes, the masters are the module's parameters); ``offload_optimizer: cpu``: host memory (the
  masters pinned when ``pin_memory``, Adam's moments pageable); ``nvme``: files, F ≈ 4S each for
  the masters and each of Adam's two moments (every sub-group's row at an aligned offset), plus
  host buffers: ``min(buffer_count, sub-groups)`` slots of the largest sub-group, one fp32 tensor
  per file, pinned when ``pin_memory``. With ``ratio`` below 1 (partial offload, stage 3 with
  ``cpu``) the first ``int((1 - ratio) * n)`` of the ``n`` sub-groups keep their masters and moments
  on the device (named ``device`` without an accelerator too, as ``memory_placement()`` names them)
  and the ZeRO-3 parameter shard is a copy of its own, c·S on the device.
- ``parameter_shard``: stages 1–2 with the masters in files, a compute-dtype copy c·S on the device
  that the all-gather publishes from (``memory_placement()`` does not report it).
- ``parameter_shard`` (stage 3): none while the masters are on the device (units are gathered from
  them, cast on the way); with ``offload_optimizer`` alone a device copy c·S; ``offload_param: cpu``
  host c·S, pinned (none in fp32 with the masters in host memory: it is them); ``nvme``: a file of
  every unit's chunk at an aligned offset, and ``buffer_count`` host buffers of the largest unit.

Without an accelerator the training device *is* host memory: fp32 masters at stages 1–2 stay the
module's parameters (no master bytes, no master file), ZeRO-3 keeps no parameter shard unless it is
in a file, nothing is pinned, and everything in memory is ``host``, as ``memory_placement()``
reports it. Adam's step counters (4 bytes per parameter tensor) are left out, and in-memory Adam
state is counted on the padded shard (torch keeps it for the real elements only: at most N−1
elements per parameter fewer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zeroshard.core.offload.policy import Residency, device_subgroups, resolve_sub_group_size, swap_slots
from zeroshard.core.offload.swap_files import ALIGNMENT, round_up
from zeroshard.core.partition import ShardLayout, consecutive_runs
from zeroshard.core.plan import make_plan
from zeroshard.estimate.model_spec import ModelSpec
from zeroshard.estimate.states import DTYPE_BYTES, PERSISTENCE_THRESHOLD, Buckets, unit_rows

#: the config's offload device names as the core's residencies
_RESIDENCY = {"none": Residency.DEVICE, "cpu": Residency.HOST, "nvme": Residency.FILE}

__all__ = ["OFFLOAD_DEVICES", "Offload", "Placement", "bucket_rows", "offloads_for_stage", "placement",
           "subgroup_sizes", "unit_rows"]

#: values of ``offload_optimizer.device`` / ``offload_param.device``, slowest last
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
#: Adam's per-element state tensors (``exp_avg``, ``exp_avg_sq``), one swap file each
_ADAM_KEYS = 2
#: DeepSpeed's default ``offload_param.buffer_size`` (elements); the planner raises it to the largest unit
PARAM_BUFFER_SIZE = 100_000_000


@dataclass(frozen=True)
class Offload:
    """An offload choice and the knobs that size its buffers (DeepSpeed's defaults)."""

    optimizer: str = "none"
    params: str = "none"
    #: ``None``: unset, chosen from the shard as the engine does (:func:`resolve_sub_group_size`)
    sub_group_size: int | None = None
    buffer_count: int = 4
    param_buffer_count: int = 5
    pin_memory: bool = True
    #: ``offload_optimizer.ratio``: the fraction of the optimizer's sub-groups offloaded (below 1:
    #: ZeRO-Offload++'s partial offload, stage 3 with ``optimizer="cpu"`` only)
    ratio: float = 1.0

    def __post_init__(self) -> None:
        for name in ("optimizer", "params"):
            if getattr(self, name) not in OFFLOAD_DEVICES:
                raise ValueError(f"Offload.{name} must be one of {OFFLOAD_DEVICES}, got {getattr(self, name)!r}")
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"Offload.ratio must be in [0, 1], got {self.ratio}")
        if self.ratio < 1.0 and self.optimizer != "cpu":
            raise ValueError(f"Offload.ratio below 1 (partial offload) needs optimizer='cpu', not {self.optimizer!r}")

    @property
    def partial(self) -> bool:
        """Partial optimizer offload: the leading sub-groups stay on the device."""
        return self.ratio < 1.0

    @property
    def label(self) -> str:
        """``none``, ``optimizer->cpu``, ``optimizer+params->nvme``, ``params->cpu``,
        ``optimizer->cpu (ratio 0.5)``..."""
        ratio = f" (ratio {self.ratio:g})" if self.partial else ""
        if self.params == "none":
            return "none" if self.optimizer == "none" else f"optimizer->{self.optimizer}{ratio}"
        if self.optimizer == "none":
            return f"params->{self.params}"
        if self.params == self.optimizer:
            return f"optimizer+params->{self.optimizer}{ratio}"
        return f"optimizer->{self.optimizer}{ratio},params->{self.params}"

    @property
    def tier(self) -> int:
        """0 without offload, 1 for host memory, 2 when anything goes to NVMe (slower each)."""
        return max(OFFLOAD_DEVICES.index(self.optimizer), OFFLOAD_DEVICES.index(self.params))

    @property
    def uses_nvme(self) -> bool:
        """Whether swap files are needed."""
        return self.tier == 2

    def config(self, nvme_path: str | None, largest_unit: int = 0) -> dict[str, Any]:
        """The ``zero_optimization`` keys of this choice (``nvme_path`` for NVMe blocks; the
        parameter buffers are raised to hold ``largest_unit`` elements, or set-up refuses)."""
        out: dict[str, Any] = {}
        if self.optimizer != "none":
            block: dict[str, Any] = {"device": self.optimizer, "pin_memory": self.pin_memory}
            if self.optimizer == "nvme":
                block.update(nvme_path=nvme_path, buffer_count=self.buffer_count)
            if self.partial:
                block["ratio"] = self.ratio
            if self.sub_group_size is not None and (self.optimizer == "nvme" or self.partial):
                out["sub_group_size"] = self.sub_group_size
            out["offload_optimizer"] = block
        if self.params != "none":
            block = {"device": self.params, "pin_memory": self.pin_memory}
            if self.params == "nvme":
                block.update(nvme_path=nvme_path, buffer_count=self.param_buffer_count,
                             buffer_size=max(PARAM_BUFFER_SIZE, largest_unit))
            out["offload_param"] = block
        return out


def offloads_for_stage(stage: int, sub_group_size: int | None = None) -> tuple[Offload, ...]:
    """The choices the table shows for ``stage``: none; the optimizer to cpu or nvme (stages 1–3);
    the optimizer and the parameters to cpu or nvme (stage 3)."""
    pairs = [("none", "none")]
    if stage >= 1:
        pairs += [("cpu", "none"), ("nvme", "none")]
    if stage == 3:
        pairs += [("cpu", "cpu"), ("nvme", "nvme")]
    return tuple(Offload(opt, par, sub_group_size=sub_group_size) for opt, par in pairs)


@dataclass(frozen=True)
class Placement:
    """Bytes per rank: ``kinds[kind][place]``, places ``device``, ``host``, ``pinned_host``, ``file``."""

    kinds: dict[str, dict[str, int]]

    def at(self, *places: str) -> int:
        """Bytes of every kind at any of ``places``."""
        return sum(n for by_place in self.kinds.values() for p, n in by_place.items() if p in places)

    @property
    def device(self) -> int:
        """Model state on the training device (without an accelerator it is all ``host``)."""
        return self.at("device")

    @property
    def host(self) -> int:
        """Model state and swap buffers in host memory (pageable and pinned)."""
        return self.at("host", "pinned_host")

    @property
    def file(self) -> int:
        """Bytes of swap files."""
        return self.at("file")


def bucket_rows(spec: ModelSpec, stage: int, world: int, reduce_bucket_size: int) -> list[int]:
    """Per-rank row of each bucket of the master layout: ZeRO-3 units, or at stages 1–2 runs of
    parameters (gradient order: reverse registration) up to ``reduce_bucket_size`` elements."""
    if stage == 3:
        return unit_rows(spec, world)
    if spec.param_numels is None:  # a bare count: parameters assumed small next to a bucket
        total = int(spec.total_params)
        return [ShardLayout(min(reduce_bucket_size, total - s), world).shard_numel
                for s in range(0, total, reduce_bucket_size)]
    runs = consecutive_runs(list(reversed(spec.param_numels)), lambda n: n, reduce_bucket_size)
    return [sum(ShardLayout(n, world).shard_numel for n in run) for run in runs]


def subgroup_sizes(rows: list[int], sub_group_size: int) -> list[int]:
    """Elements of each optimizer sub-group: runs of whole buckets up to ``sub_group_size``."""
    return [sum(run) for run in consecutive_runs(rows, lambda n: n, max(1, sub_group_size)) if run]


def _file_bytes(regions: list[int], itemsize: int) -> int:
    """A swap file holding each region at an aligned offset (at least one block)."""
    return max(sum(round_up(n * itemsize) for n in regions), ALIGNMENT)


#: ``add(kind, place, bytes)``
_Add = Callable[[str, str, int], None]


@dataclass(frozen=True)
class _Places:
    """The place names of one set-up (without an accelerator all memory is ``host``)."""

    device: str
    #: page-locked whenever an accelerator is present (the gradient shard)
    pinned: str
    #: page-locked when ``pin_memory`` asks for it and an accelerator is present
    pinned_if_asked: str


def placement(spec: ModelSpec, stage: int, world: int, dtype: str = "bf16", grad_accum_dtype: str = "fp32",
              offload: Offload | None = None, *, buckets: Buckets | None = None,
              persistence_threshold: int = PERSISTENCE_THRESHOLD, accelerator: bool = True) -> Placement:
    """zeroshard's bytes per rank by kind and place for Adam at ``stage`` on ``world`` ranks.

    Args:
        spec: the model.
        stage: ZeRO stage, 0–3 (offload needs 1–3, parameter offload 3).
        world: data-parallel ranks.
        dtype: compute dtype (``bf16``, ``fp16``, ``fp32``).
        grad_accum_dtype: ``data_types.grad_accum_dtype``.
        offload: the offload choice (none when ``None``).
        buckets: bucket sizes (``reduce_bucket_size`` shapes stage 1–2 sub-groups).
        persistence_threshold: ``stage3_param_persistence_threshold``.
        accelerator: training on an accelerator; without one the device is host memory.

    Raises:
        ValueError: an offload the stage does not run.
    """
    off = offload or Offload()
    if off.optimizer != "none" and stage == 0:
        raise ValueError("optimizer offload needs ZeRO stage 1-3")
    if off.partial and stage != 3:
        raise ValueError("partial optimizer offload (ratio below 1) needs ZeRO stage 3")
    if off.params != "none" and stage != 3:
        raise ValueError("parameter offload needs ZeRO stage 3")
    buckets = buckets or Buckets()
    c, a = DTYPE_BYTES[dtype], DTYPE_BYTES[grad_accum_dtype]
    psi = int(spec.total_params)
    bucket_size = buckets.reduce_bucket_size
    layout_world = world if stage else 1
    sub_group = resolve_sub_group_size(off.sub_group_size, -(-psi // layout_world), off.buffer_count,
                                       off.optimizer == "nvme")
    if off.optimizer == "nvme" and stage < 3:  # the engine keeps buckets within a sub-group there
        bucket_size = min(bucket_size, sub_group * world)
    rows = [psi] if stage == 0 else bucket_rows(spec, stage, world, bucket_size)
    shard = sum(rows)
    host_pin = "pinned_host" if accelerator else "host"
    where = _Places("device" if accelerator else "host", host_pin,
                    "pinned_host" if accelerator and off.pin_memory else "host")
    kinds: dict[str, dict[str, int]] = {}

    def add(kind: str, place: str, n: int) -> None:
        if n:
            kinds.setdefault(kind, {})
            kinds[kind][place] = kinds[kind].get(place, 0) + n

    persistent = sum(u for u in spec.units or () if u <= persistence_threshold)
    add("parameters", where.device, c * (persistent if stage == 3 else psi))
    _gradients(add, stage, world, a * shard, off, where)
    # The engine's plan of the same stage: which copies exist (fp32 masters at stages 0-2 are the
    # module's own parameters when both share memory; NVMe masters are swapped unless aliased).
    plan = make_plan(stage, world, c == 4, _RESIDENCY[off.optimizer], _RESIDENCY[off.params], accelerator,
                     split_masters=off.partial)
    aliased, swapped = plan.masters_alias_params, plan.masters_swapped
    sizes = subgroup_sizes(rows, sub_group)
    master_file = _file_bytes(sizes, 4)
    # In host memory the masters are page-locked (updated values reach the device asynchronously);
    # the moments torch creates beside them (``zeros_like``) are not.
    masters = {"none": where.device, "cpu": where.pinned_if_asked, "nvme": "file"}[off.optimizer]
    if plan.masters_split:
        # The first int((1 - ratio) * n) sub-groups keep their masters and moments on the device
        # (named so without an accelerator too, as memory_placement() names them), the rest offloaded.
        kept = sum(sizes[: device_subgroups(off.ratio, len(sizes))])
        add("master_weights", "device", 4 * kept)
        add("master_weights", masters, 4 * (shard - kept))
        add("optimizer_states", "device", 8 * kept)
        add("optimizer_states", "host", 8 * (shard - kept))
    else:
        if not aliased:
            add("master_weights", masters, master_file if swapped else 4 * shard)
        if off.optimizer == "nvme":
            add("optimizer_states", "file", _ADAM_KEYS * master_file)
            slots = swap_slots(off.buffer_count, sizes, off.sub_group_size is None)
            add("optimizer_states", where.pinned_if_asked, slots * max(sizes) * 4 * (_ADAM_KEYS + swapped))
            if plan.compute_copy:  # the compute-dtype copy stages 1-2 all-gather from
                add("parameter_shard", where.device, c * shard)
        else:
            add("optimizer_states", where.device if off.optimizer == "none" else "host", 8 * shard)
    if stage == 3 and not plan.param_shard_aliases_masters:
        _parameter_shard(add, rows, c, off, where)
    return Placement(kinds)


def _gradients(add: _Add, stage: int, world: int, shard_bytes: int, off: Offload, where: _Places) -> None:
    """Stage 0: the whole accumulator; stage 1: every rank's rows (reduce-scattered at the
    boundary); stages 2-3: this rank's shard, in pinned host memory next to an offloaded step, or
    with NVMe in a file-backed buffer whose pages the process holds only while it uses them."""
    if stage <= 1:
        add("gradients", where.device, shard_bytes * (world if stage == 1 else 1))
    elif off.optimizer == "nvme":
        add("gradients", "file", shard_bytes)
    else:
        add("gradients", where.device if off.optimizer == "none" else where.pinned, shard_bytes)


def _parameter_shard(add: _Add, rows: list[int], c: int, off: Offload, where: _Places) -> None:
    """ZeRO-3's compute-dtype shard, where the plan keeps one (``StagePlan.param_shard_aliases_masters``
    false: the masters are not where units are gathered from)."""
    if off.params == "nvme":
        add("parameter_shard", "file", _file_bytes(rows, c))
        add("parameter_shard", where.pinned_if_asked, off.param_buffer_count * max(max(rows, default=1), 1) * c)
        return
    add("parameter_shard", where.device if off.params == "none" else where.pinned_if_asked, c * sum(rows))
