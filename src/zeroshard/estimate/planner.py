"""The estimate table (stages 0–3 × offload, with activations) and the planner that picks a config.

:func:`estimate` returns one :class:`Row` per stage and offload choice. Rows without offload are
zeroshard's own residency (:mod:`zeroshard.estimate.states`, which matches
``engine.memory_usage()``) plus its communication buffers and ZeRO-3 gathered units; rows
with offload are DeepSpeed's numbers (:mod:`zeroshard.estimate.formulas`), since zeroshard does
not offload yet. Activations (:mod:`zeroshard.estimate.activations`) are added to every row, with
and without activation checkpointing.

:func:`plan` picks the fastest configuration zeroshard runs today that fits the given memory.
Fastest first: no activation checkpointing before checkpointing (recomputing the forward costs
about a third more compute), then stage 0, 1, 2, 3 (ZeRO-3 moves 1.5× the bytes of stages 0–2),
and for each the largest communication buckets first. A configuration fits when its GPU bytes are
at most ``(1 - headroom)`` of the GPU memory (the headroom covers the CUDA context, allocator
fragmentation and temporaries) and its CPU bytes per node at most the CPU memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zeroshard.errors import ZeroshardError
from zeroshard.estimate.activations import ActivationEstimate, estimate_activations
from zeroshard.estimate.formulas import estimate_zero2_model_states_mem_needs, estimate_zero3_model_states_mem_needs
from zeroshard.estimate.model_spec import ModelSpec
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


class PlanError(ZeroshardError):
    """No configuration zeroshard can run today fits the memory given."""


@dataclass(frozen=True)
class Hardware:
    """Where the model trains. Memory figures are bytes; ``cpu_memory`` is per node."""

    gpus_per_node: int = 1
    nodes: int = 1
    gpu_memory: int | None = None
    cpu_memory: int | None = None

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


@dataclass(frozen=True)
class Row:
    """One line of the table: bytes per GPU and per node for a stage and offload choice.

    ``source`` is ``"zeroshard"`` (zeroshard's residency, runs today) or ``"DeepSpeed"`` (offload:
    DeepSpeed's numbers; zeroshard does not offload yet). ``activations`` and
    ``activations_ckpt`` are ``None`` when unknown.
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

    @property
    def runs_today(self) -> bool:
        """Whether zeroshard can train this configuration now (no offload)."""
        return self.offload == "none"

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
                  buckets: Buckets | None = None) -> Row:
    """The row for ``stage`` without offload, as zeroshard runs it."""
    _, act, act_ckpt = _activations(spec, training)
    states = model_states(spec, stage, hardware.world, training.dtype, training.grad_accum_dtype, buckets)
    # CPU: each process builds its model on the CPU (fp32) before initialize moves it; at ZeRO-3
    # under zero.Init only one module at a time (DeepSpeed's zero_init rows say the same).
    if stage == 3:
        cpu, _, _ = estimate_zero3_model_states_mem_needs(spec.total_params, spec.largest_layer_params,
                                                          hardware.gpus_per_node, hardware.nodes, False, False,
                                                          True, BUFFER_FACTOR)
    else:
        cpu, _ = estimate_zero2_model_states_mem_needs(spec.total_params, hardware.gpus_per_node, hardware.nodes,
                                                       False, BUFFER_FACTOR)
    return Row(stage, "none", states.total, states.buffers, act, act_ckpt, cpu, "zeroshard", states,
               buckets or Buckets())


def _deepspeed_rows(spec: ModelSpec, hardware: Hardware, act: int | None, act_ckpt: int | None) -> list[Row]:
    rows = []
    gpn, nodes, psi = hardware.gpus_per_node, hardware.nodes, spec.total_params
    cpu, gpu = estimate_zero2_model_states_mem_needs(psi, gpn, nodes, True, BUFFER_FACTOR)
    for stage in (1, 2):
        rows.append(Row(stage, "optimizer", gpu, 0, act, act_ckpt, cpu, "DeepSpeed"))
    for offload, params in (("optimizer", False), ("optimizer+params", True)):
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(psi, spec.largest_layer_params, gpn, nodes, True, params,
                                                            True, BUFFER_FACTOR)
        rows.append(Row(3, offload, gpu, 0, act, act_ckpt, cpu, "DeepSpeed"))
    return rows


def estimate(spec: ModelSpec, hardware: Hardware, training: Training) -> Estimate:
    """Every stage without offload (zeroshard) and with offload (DeepSpeed's numbers)."""
    act_est, act, act_ckpt = _activations(spec, training)
    rows = [zeroshard_row(spec, hardware, training, stage) for stage in range(4)]
    rows += _deepspeed_rows(spec, hardware, act, act_ckpt)
    rows.sort(key=lambda r: (r.stage, r.source != "zeroshard"))
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
    return hardware.cpu_memory is None or row.cpu_per_node <= hardware.cpu_memory


def ds_config(row: Row, training: Training, lr: float = 1e-4) -> dict[str, Any]:
    """A DeepSpeed config (that zeroshard accepts) for a zeroshard row: batch size per GPU (so it
    runs at any world size), precision, AdamW, and the row's stage and bucket sizes."""
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
    cfg["zero_optimization"] = zero
    return cfg


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


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
        return f"ZeRO-3 would fit on {need} GPUs of this size"
    gpu_only = Hardware(hardware.gpus_per_node, hardware.nodes, hardware.gpu_memory, None)
    need = _min_gpus(spec, gpu_only, training, checkpointing, headroom)
    if need:
        cpu = zeroshard_row(spec, gpu_only, training, 3).cpu_per_node
        return (f"on {need} GPUs ZeRO-3 would fit in GPU memory, but it needs {_gib(cpu)} of CPU memory per node "
                "(each process builds its largest layer there)")
    return ("not on any number of these GPUs either: what every GPU holds whatever the sharding (activations, "
            "buffers, the gathered largest layers) exceeds the memory; lower --micro-batch or --seq-len")


def plan(spec: ModelSpec, hardware: Hardware, training: Training, headroom: float = 0.1) -> Plan:
    """The fastest configuration zeroshard runs today that fits ``hardware``'s memory.

    Raises:
        PlanError: nothing fits; the message says whether offload (not yet supported) would, or
            how many GPUs ZeRO-3 needs.
    """
    if hardware.gpu_memory is None:
        raise ValueError("plan() needs hardware.gpu_memory")
    act_est, act, _ = _activations(spec, training)
    ckpt_choices = (False, True) if act_est is not None else (False,)
    notes = []
    if act is None:
        notes.append("activations are not included (a factory model or a bare count): pass a Hugging Face "
                     "config or --activation-bytes to count them")
    for checkpointing in ckpt_choices:
        for stage in range(4):
            for buckets in BUCKET_TIERS:
                row = zeroshard_row(spec, hardware, training, stage, buckets)
                if _fits(row, hardware, checkpointing, headroom):
                    if checkpointing:
                        notes.append("activation checkpointing is needed: enable it in the model "
                                     "(model.gradient_checkpointing_enable() for Hugging Face models, or "
                                     "torch.utils.checkpoint around each layer); zeroshard does not take it "
                                     "from the config's activation_checkpointing block yet")
                    if stage == 3:
                        notes.append("the CPU figure assumes the model is built under "
                                     "zeroshard.zero.Init(config_dict_or_path=...), one module at a time")
                    return Plan(row, checkpointing, ds_config(row, training), notes)
    budget = (1 - headroom) * hardware.gpu_memory
    est = estimate(spec, hardware, training)
    offload = [r for r in est.rows if not r.runs_today
               and any(_fits(r, hardware, ck, headroom) for ck in ckpt_choices)]
    last = ckpt_choices[-1]
    best = min((r for r in est.rows if r.runs_today), key=lambda r: r.gpu_total(last))
    msg = (f"no configuration zeroshard runs today fits: the smallest, stage {best.stage}"
           f"{' with activation checkpointing' if last else ''}, needs {_gib(best.gpu_total(last))} per GPU "
           f"(limit {_gib(budget)}: {_gib(hardware.gpu_memory)} less {headroom:.0%} headroom)")
    if hardware.cpu_memory is not None and best.cpu_per_node > hardware.cpu_memory:
        msg += f" and {_gib(best.cpu_per_node)} of CPU memory per node (limit {_gib(hardware.cpu_memory)})"
    if offload:
        r = offload[0]
        msg += (f". DeepSpeed's estimate says stage {r.stage} with {r.offload} offloaded to the CPU would fit "
                f"({_gib(r.gpu_total(last))} per GPU, {_gib(r.cpu_per_node)} CPU per node), but offload is not "
                "yet supported by zeroshard")
    else:
        msg += f". It does not fit with offload either; {_no_fit_hint(spec, hardware, training, last, headroom)}"
    raise PlanError(msg)
