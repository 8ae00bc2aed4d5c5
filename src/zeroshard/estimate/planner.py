"""The estimate table (stages 0–3 × offload, with activations) and the planner that picks a config.

:func:`estimate` returns one :class:`Row` per stage and offload choice (none; the optimizer to
CPU or NVMe at stages 1–3; the optimizer and the parameters to CPU or NVMe at stage 3), all
zeroshard's own residency: :mod:`zeroshard.estimate.residency` says which bytes stay on the GPU,
which go to host memory and which to swap files, and :mod:`zeroshard.estimate.states` adds the
communication buffers and ZeRO-3 gathered units. Activations
(:mod:`zeroshard.estimate.activations`) are added to every row, with and without activation
checkpointing.

:func:`plan` picks the fastest configuration that fits. Fastest first: no offload, then the
optimizer (and parameters) in host memory, then NVMe swap files (only with a disk budget); within
each, no activation checkpointing before checkpointing (recomputing the forward costs about a
third more compute, moving the optimizer off the GPU far more), then the lowest stage (ZeRO-3 moves
1.5× the bytes of stages 0–2; at stage 3 optimizer offload before parameter offload), and for each
the largest communication buckets (and NVMe sub-groups) first. A configuration fits when its GPU
bytes are at most ``(1 - headroom)`` of the GPU memory (the headroom covers the CUDA context,
allocator fragmentation and temporaries), its CPU bytes per node at most the CPU memory and its
swap files at most the NVMe budget per node.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from zeroshard.errors import ZeroshardError
from zeroshard.estimate.activations import ActivationEstimate, estimate_activations
from zeroshard.estimate.formulas import estimate_zero2_model_states_mem_needs, estimate_zero3_model_states_mem_needs
from zeroshard.estimate.model_spec import ModelSpec
from zeroshard.estimate.residency import Offload, Placement, offloads_for_stage, placement, unit_rows
from zeroshard.estimate.states import DTYPE_BYTES, Buckets, StateEstimate, model_states

__all__ = ["BUCKET_TIERS", "Estimate", "Hardware", "Plan", "PlanError", "Row", "Training", "estimate", "plan"]

#: CPU safety factor, as DeepSpeed's ``additional_buffer_factor``
BUFFER_FACTOR = 1.5

#: bucket sizes and ZeRO-3 budgets the planner tries, fastest (fewest collectives) first
BUCKET_TIERS: tuple[Buckets, ...] = (
    Buckets(),
    Buckets(200_000_000, 200_000_000, 200_000_000, 50_000_000),
    Buckets(50_000_000, 50_000_000, 50_000_000, 20_000_000),
)
#: optimizer sub-groups the planner tries with NVMe offload (fewer, larger reads first; smaller
#: ones need less host memory for the swap buffers; ``None``: left unset, chosen by the engine)
SUB_GROUP_TIERS: tuple[int | None, ...] = (1_000_000_000, 100_000_000, None)


class PlanError(ZeroshardError):
    """No configuration fits the memory given, or the one that fits needs an NVMe path."""


@dataclass(frozen=True)
class Hardware:
    """Where the model trains. Memory figures are bytes; ``cpu_memory`` and ``nvme_memory`` (the
    disk for swap files; ``None``: no NVMe offload) are per node."""

    gpus_per_node: int = 1
    nodes: int = 1
    gpu_memory: int | None = None
    cpu_memory: int | None = None
    nvme_memory: int | None = None

    @property
    def world(self) -> int:
        """Data-parallel ranks."""
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Training:
    """How it trains: precision, micro batch per GPU, sequence length, attention kernel.

    ``activation_bytes`` replaces the activation estimate (for models without a transformer
    config); it is then used with and without checkpointing alike.
    """

    dtype: str = "bf16"
    grad_accum_dtype: str = "fp32"
    micro_batch: int = 1
    seq_len: int = 2048
    attention: str = "sdpa"
    activation_bytes: int | None = None
    #: ZeRO++ hpZ's ``zero_hpz_partition_size`` (stage 3 rows count its secondary shards)
    hpz_partition_size: int = 1


@dataclass(frozen=True)
class Row:
    """One line of the table: bytes per GPU, per node and on disk for a stage and offload choice.

    ``model_states`` is what stays on the GPU (offloaded state is in ``cpu_per_node`` or
    ``nvme_per_node``); ``placement`` has every kind by place, per rank. ``activations`` and
    ``activations_ckpt`` are ``None`` when unknown. ``source`` is ``"zeroshard"``: every row is
    zeroshard's own residency, and runs.
    """

    stage: int
    offload: str
    model_states: int
    buffers: int
    activations: int | None
    activations_ckpt: int | None
    cpu_per_node: int
    source: str
    states: StateEstimate | None = None
    buckets: Buckets | None = None
    choice: Offload = Offload()
    placement: Placement | None = None
    nvme_per_node: int = 0

    def gpu_total(self, checkpointing: bool = False) -> int:
        """Bytes per GPU: model states, buffers and activations (0 when activations are unknown)."""
        act = self.activations_ckpt if checkpointing else self.activations
        return self.model_states + self.buffers + (act or 0)


@dataclass
class Estimate:
    """The rows for one model, hardware and training set-up."""

    spec: ModelSpec
    hardware: Hardware
    training: Training
    activations: ActivationEstimate | None
    rows: list[Row] = field(default_factory=list)


def _activations(spec: ModelSpec, training: Training) -> tuple[ActivationEstimate | None, int | None, int | None]:
    if training.activation_bytes is not None:
        return None, training.activation_bytes, training.activation_bytes
    if spec.transformer is None:
        return None, None, None
    act = estimate_activations(spec.transformer, training.micro_batch, training.seq_len,
                               DTYPE_BYTES[training.dtype], training.attention)
    return act, act.total, act.checkpointed


def zeroshard_row(spec: ModelSpec, hardware: Hardware, training: Training, stage: int,
                  buckets: Buckets | None = None, offload: Offload | None = None) -> Row:
    """The row for ``stage`` and ``offload`` (none when ``None``), as zeroshard runs it."""
    _, act, act_ckpt = _activations(spec, training)
    buckets = buckets or Buckets()
    offload = offload or Offload()
    states = model_states(spec, stage, hardware.world, training.dtype, training.grad_accum_dtype, buckets,
                          hpz_partition_size=training.hpz_partition_size)
    place = placement(spec, stage, hardware.world, training.dtype, training.grad_accum_dtype, offload,
                      buckets=buckets)
    # CPU: each process builds its model on the CPU (fp32) before initialize moves it; at ZeRO-3
    # under zero.Init only one module at a time (DeepSpeed's zero_init rows say the same).
    if stage == 3:
        build, _, _ = estimate_zero3_model_states_mem_needs(spec.total_params, spec.largest_layer_params,
                                                            hardware.gpus_per_node, hardware.nodes, False, False,
                                                            True, BUFFER_FACTOR)
    else:
        build, _ = estimate_zero2_model_states_mem_needs(spec.total_params, hardware.gpus_per_node, hardware.nodes,
                                                         False, BUFFER_FACTOR)
    # The offloaded state is made by initialize and the first step, once the model's CPU copy has
    # moved to the GPU: the node needs the larger of the two, not their sum.
    cpu = max(build, hardware.gpus_per_node * place.host)
    return Row(stage, offload.label, place.device, states.buffers, act, act_ckpt, cpu, "zeroshard", states,
               buckets, offload, place, hardware.gpus_per_node * place.file)


def estimate(spec: ModelSpec, hardware: Hardware, training: Training, offload_ratio: float | None = None,
             sub_group_size: int | None = None) -> Estimate:
    """Every stage with every offload choice it runs, at DeepSpeed's default sizes; with
    ``offload_ratio`` below 1, also stage 3 with that fraction of the optimizer offloaded to the CPU
    (ZeRO-Offload++), in sub-groups of ``sub_group_size`` elements (``None``: DeepSpeed's default,
    1e9, which splits only shards larger than that)."""
    act_est, _, _ = _activations(spec, training)
    rows = [zeroshard_row(spec, hardware, training, stage, offload=off)
            for stage in range(4) for off in offloads_for_stage(stage)]
    if offload_ratio is not None and offload_ratio < 1.0:
        partial = Offload("cpu", sub_group_size=sub_group_size, ratio=offload_ratio)
        at = next(i for i, r in enumerate(rows) if (r.stage, r.choice) == (3, Offload("cpu")))
        rows.insert(at + 1, zeroshard_row(spec, hardware, training, 3, offload=partial))
    return Estimate(spec, hardware, training, act_est, rows)


@dataclass
class Plan:
    """The chosen configuration: its row, whether the model must checkpoint activations, the
    ready-to-use DeepSpeed config and remarks for the user."""

    row: Row
    checkpointing: bool
    config: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def _fits(row: Row, hardware: Hardware, checkpointing: bool, headroom: float) -> bool:
    assert hardware.gpu_memory is not None
    if row.gpu_total(checkpointing) > (1 - headroom) * hardware.gpu_memory:
        return False
    if row.nvme_per_node and (hardware.nvme_memory is None or row.nvme_per_node > hardware.nvme_memory):
        return False
    return hardware.cpu_memory is None or row.cpu_per_node <= hardware.cpu_memory


def ds_config(row: Row, training: Training, lr: float = 1e-4, nvme_path: str | None = None,
              largest_unit: int = 0) -> dict[str, Any]:
    """A DeepSpeed config (that zeroshard accepts) for a zeroshard row: batch size per GPU (so it
    runs at any world size), precision, AdamW, the row's stage, bucket sizes and offload blocks
    (swap files under ``nvme_path``; ``largest_unit``: elements of the largest ZeRO-3 unit, which
    the parameter swap buffers must hold)."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": training.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
    }
    if training.dtype in ("bf16", "fp16"):
        cfg[training.dtype] = {"enabled": True}
    if training.grad_accum_dtype != "fp32":
        cfg["data_types"] = {"grad_accum_dtype": training.grad_accum_dtype}
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                     "weight_decay": 0.01}}
    zero: dict[str, Any] = {"stage": row.stage}
    if row.stage >= 1:
        zero["overlap_comm"] = True
    zero.update((row.buckets or Buckets()).config(row.stage))
    zero.update(row.choice.config(nvme_path, largest_unit))
    if row.stage == 3 and training.hpz_partition_size > 1:
        zero["zero_hpz_partition_size"] = training.hpz_partition_size
    cfg["zero_optimization"] = zero
    return cfg


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _candidates(spec: ModelSpec, hardware: Hardware, training: Training, tier: int) -> Iterator[Row]:
    """The rows of one offload tier, fastest first: lowest stage, optimizer offload before
    parameter offload, largest sub-groups and buckets."""
    sub_groups = SUB_GROUP_TIERS if tier == 2 else (None,)
    for stage in range(4):
        for index in range(len(offloads_for_stage(stage))):
            for sub_group in sub_groups:
                off = offloads_for_stage(stage, sub_group)[index]
                if off.tier != tier:
                    continue
                for buckets in BUCKET_TIERS:
                    yield zeroshard_row(spec, hardware, training, stage, buckets, off)


def _min_gpus(spec: ModelSpec, hardware: Hardware, training: Training, checkpointing: bool,
              headroom: float) -> int | None:
    """Fewest GPUs (whole nodes of this size) on which ZeRO-3 fits, or ``None`` up to 65536."""
    nodes = hardware.nodes
    while hardware.gpus_per_node * nodes <= 65536:
        hw = Hardware(hardware.gpus_per_node, nodes, hardware.gpu_memory, hardware.cpu_memory)
        for buckets in BUCKET_TIERS:
            if _fits(zeroshard_row(spec, hw, training, 3, buckets), hw, checkpointing, headroom):
                return hw.world
        nodes = nodes * 2 if nodes >= 8 else nodes + 1
    return None


def _no_fit_hint(spec: ModelSpec, hardware: Hardware, training: Training, checkpointing: bool,
                 headroom: float) -> str:
    """What would make ZeRO-3 fit: more GPUs, more CPU memory, or smaller activations."""
    need = _min_gpus(spec, hardware, training, checkpointing, headroom)
    if need:
        return f"ZeRO-3 without offload would fit on {need} GPUs of this size"
    gpu_only = Hardware(hardware.gpus_per_node, hardware.nodes, hardware.gpu_memory, None)
    need = _min_gpus(spec, gpu_only, training, checkpointing, headroom)
    if need:
        cpu = zeroshard_row(spec, gpu_only, training, 3).cpu_per_node
        return (f"on {need} GPUs ZeRO-3 would fit in GPU memory, but it needs {_gib(cpu)} of CPU memory per node "
                "(each process builds its largest layer there)")
    return ("not on any number of these GPUs either: what every GPU holds whatever the sharding (activations, "
            "buffers, the gathered largest layers) exceeds the memory; lower --micro-batch or --seq-len")


def _offload_notes(row: Row, hardware: Hardware, nvme_path: str | None) -> list[str]:
    notes = []
    if row.choice.optimizer != "none":
        notes.append(f"{row.choice.label}: the optimizer steps on the CPU ({_gib(row.cpu_per_node)} of host "
                     "memory per node)")
        if hardware.cpu_memory is None:
            notes.append("host memory was not checked (no --cpu-memory given)")
    if row.choice.uses_nvme:
        notes.append(f"swap files go under {nvme_path}: {_gib(row.nvme_per_node)} per node, on a local NVMe drive "
                     "(one directory per process, removed at exit)")
    return notes


def plan(spec: ModelSpec, hardware: Hardware, training: Training, headroom: float = 0.1,
         nvme_path: str | None = None) -> Plan:
    """The fastest configuration that fits ``hardware``'s memory (NVMe offload only when
    ``hardware.nvme_memory`` is given; its swap files go under ``nvme_path``).

    Raises:
        PlanError: nothing fits (the message says how many GPUs ZeRO-3 needs, or that NVMe offload
            would fit), or the fastest fit is an NVMe one and ``nvme_path`` is ``None``.
    """
    if hardware.gpu_memory is None:
        raise ValueError("plan() needs hardware.gpu_memory")
    act_est, act, _ = _activations(spec, training)
    ckpt_choices = (False, True) if act_est is not None else (False,)
    notes = []
    if act is None:
        notes.append("activations are not included (a factory model or a bare count): pass a Hugging Face "
                     "config or --activation-bytes to count them")
    tiers = (0, 1, 2) if hardware.nvme_memory is not None else (0, 1)
    for tier in tiers:
        for checkpointing in ckpt_choices:
            for row in _candidates(spec, hardware, training, tier):
                if _fits(row, hardware, checkpointing, headroom):
                    return _chosen(spec, row, checkpointing, training, hardware, nvme_path, notes)
    raise PlanError(_nothing_fits(spec, hardware, training, headroom, ckpt_choices[-1]))


def _chosen(spec: ModelSpec, row: Row, checkpointing: bool, training: Training, hardware: Hardware,
            nvme_path: str | None, notes: list[str]) -> Plan:
    if row.choice.uses_nvme and nvme_path is None:
        raise PlanError(f"the fastest configuration that fits is stage {row.stage} with {row.choice.label} "
                        f"({_gib(row.nvme_per_node)} of swap files per node): give nvme_path (--nvme-path), "
                        "the directory on the NVMe drive where they go")
    if checkpointing:
        notes.append("activation checkpointing is needed: enable it in the model "
                     "(model.gradient_checkpointing_enable() for Hugging Face models, or "
                     "torch.utils.checkpoint around each layer); zeroshard does not take it "
                     "from the config's activation_checkpointing block yet")
    if row.stage == 3:
        notes.append("the CPU figure assumes the model is built under "
                     "zeroshard.zero.Init(config_dict_or_path=...), one module at a time")
    notes += _offload_notes(row, hardware, nvme_path)
    largest_unit = max(unit_rows(spec, 1), default=0)
    return Plan(row, checkpointing, ds_config(row, training, nvme_path=nvme_path, largest_unit=largest_unit), notes)


def _nothing_fits(spec: ModelSpec, hardware: Hardware, training: Training, headroom: float, last: bool) -> str:
    """Why nothing fits, and what would."""
    assert hardware.gpu_memory is not None
    budget = (1 - headroom) * hardware.gpu_memory
    rows = estimate(spec, hardware, training).rows
    allowed = [r for r in rows if hardware.nvme_memory is not None or not r.choice.uses_nvme]
    best = min(allowed, key=lambda r: r.gpu_total(last))
    msg = (f"no configuration fits: the smallest on the GPU, stage {best.stage} with offload {best.offload}"
           f"{' and activation checkpointing' if last else ''}, needs {_gib(best.gpu_total(last))} per GPU "
           f"(limit {_gib(budget)}: {_gib(hardware.gpu_memory)} less {headroom:.0%} headroom)")
    if hardware.cpu_memory is not None and best.cpu_per_node > hardware.cpu_memory:
        msg += f" and {_gib(best.cpu_per_node)} of CPU memory per node (limit {_gib(hardware.cpu_memory)})"
    if hardware.nvme_memory is not None and best.nvme_per_node > hardware.nvme_memory:
        msg += f" and {_gib(best.nvme_per_node)} of NVMe per node (limit {_gib(hardware.nvme_memory)})"
    if hardware.nvme_memory is None:
        unlimited = Hardware(hardware.gpus_per_node, hardware.nodes, hardware.gpu_memory, hardware.cpu_memory,
                             nvme_memory=2**62)
        nvme = next((r for r in _candidates(spec, unlimited, training, 2) if _fits(r, unlimited, last, headroom)),
                    None)
        if nvme is not None:
            return (msg + f". With NVMe offload it would fit: stage {nvme.stage} with {nvme.offload} needs "
                    f"{_gib(nvme.gpu_total(last))} per GPU, {_gib(nvme.cpu_per_node)} of CPU memory and "
                    f"{_gib(nvme.nvme_per_node)} of NVMe per node; give --nvme-gb (disk per node) and --nvme-path")
    return msg + f". {_no_fit_hint(spec, hardware, training, last, headroom)}"
