"""Write a checkpoint (zeroshard's, or DeepSpeed's at another world size) in DeepSpeed 0.19's layout.

``zeroshard convert CKPT OUT --to deepspeed --world-size N`` calls :func:`write_deepspeed_checkpoint`:
``OUT/<tag>/`` receives what ``DeepSpeedEngine.save_checkpoint`` would have written from ``N``
ranks at the target stage and precision, ``OUT/latest`` names the tag, so a DeepSpeed job with
the same world size, stage, precision and param groups resumes with ``load_checkpoint(OUT)``.

Flat layouts (DeepSpeed's, with its defaults ``round_robin_gradients=false`` and
``parameter_alignment=false``), per param group, parameters in the source's order:

- stages 1–2 (``stage_1_and_2.py``): the group's parameters concatenated, padded with zeros to a
  multiple of ``2 * N`` (``nccl_start_alignment_factor``) and cut into ``N`` equal partitions
  ``P``. Rank ``r`` stores its partition without the tail padding
  (``single_partition_of_fp32_groups``, the padding in ``group_paddings``) and the optimizer
  state over the padded partition (``base_optimizer_state``, the torch ``state_dict`` layout).
- stage 3 (``stage3.py``): each parameter is padded to a multiple of ``N`` and cut into ``N``
  chunks; rank ``r``'s chunks of a group's parameters are concatenated, split into sub-groups of
  at least ``sub_group_size`` elements (``fp32_flat_groups``), one optimizer state per sub-group.

Optimizer state is written for DeepSpeed's Adam family (FusedAdam, DeepSpeedCPUAdam, torch's
Adam/AdamW): elementwise tensors as fp32 partitions, ``step`` as the integer FusedAdam keeps; the
param groups carry the source's hyperparameters (plus ``bias_correction``, which FusedAdam reads).
Each rank's partition is assembled from the source by element ranges, so memory stays near one
partition per state.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeroshard.checkpoint import ds_pickle
from zeroshard.checkpoint.atomic import new_nonce
from zeroshard.checkpoint.collect import SHARDED
from zeroshard.checkpoint.open import open_source
from zeroshard.checkpoint.paths import LATEST_FILE, plain_name, resolve_checkpoint
from zeroshard.checkpoint.source import MASTER, CheckpointSource
from zeroshard.errors import CheckpointError

logger = logging.getLogger("zeroshard")

DS_VERSION = "0.19.8"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: Keys of a DeepSpeed model-states file that client state must not overwrite.
_RESERVED = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
             "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps",
             "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
             "checkpoint_parallel_dimensions"}


@dataclass(frozen=True)
class DeepSpeedTarget:
    """The DeepSpeed job that will load the checkpoint: what its files must match."""

    world_size: int
    stage: int
    dtype: torch.dtype
    gradient_clipping: float | None = None
    """Written as ``clip_grad`` at stages 1-2, which DeepSpeed's load adopts over the job's own
    setting; ``None``: the source checkpoint's, else 0 (DeepSpeed's default, no clipping)."""
    sub_group_size: int = 10**9
    ds_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise CheckpointError(f"DeepSpeed target world size must be at least 1, got {self.world_size}")
        if self.stage not in (1, 2, 3):
            raise CheckpointError(f"DeepSpeed ZeRO checkpoints exist for stages 1, 2 and 3, not {self.stage}")
        if self.dtype not in _DTYPES.values():
            raise CheckpointError(f"DeepSpeed target dtype must be fp32, bf16 or fp16, not {self.dtype}")


def target_from_config(config: dict[str, Any], world_size: int, src: CheckpointSource) -> DeepSpeedTarget:
    """Stage, precision, clipping and sub-group size from a DeepSpeed config dict; what it does not
    say, or leaves ``"auto"`` (a Hugging Face config, filled from the training arguments at run
    time), comes from the source checkpoint (stage, precision, clipping) or DeepSpeed's defaults."""
    stage = _number(config, "zero_optimization.stage")
    blocks = [(kind, config[key].get("enabled")) for key, kind in
              (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16))
              if isinstance(config.get(key), dict)]
    on = [kind for kind, enabled in blocks if enabled is True]
    if on:
        dtype = on[0]
    elif blocks and all(enabled is not None and enabled != "auto" for _, enabled in blocks):
        dtype = torch.float32  # the blocks turn 16-bit training off
    else:
        dtype = source_dtype(src)
    clip = _number(config, "gradient_clipping")
    sub_group = _number(config, "zero_optimization.sub_group_size")
    return DeepSpeedTarget(world_size, int(stage) if stage is not None else max(src.zero_stage, 1), dtype, clip,
                           int(sub_group) if sub_group is not None else 10**9, config)


def _number(config: dict[str, Any], path: str) -> float | None:
    """The value at the dotted ``path`` as a number; ``None`` when absent or ``"auto"``."""
    *blocks, key = path.split(".")
    for block in blocks:
        config = config.get(block) or {}
    value = config.get(key)
    if value is None or value == "auto":
        return None
    try:
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    except (TypeError, ValueError):
        raise CheckpointError(f"DeepSpeed config: {path} is {value!r}, expected a number or \"auto\"") from None


def clipping(target: DeepSpeedTarget, src: CheckpointSource) -> float:
    """The ``clip_grad`` to write: the target's, else the source's, else 0 with a warning, as
    DeepSpeed's stage 1-2 load replaces the job's gradient_clipping with it."""
    if target.gradient_clipping is not None:
        return target.gradient_clipping
    if src.gradient_clipping is not None:
        return src.gradient_clipping
    warnings.warn(f"{src.path} does not record its gradient clipping; the DeepSpeed checkpoint says 0 (none), which "
                  "DeepSpeed's ZeRO-1/2 load puts in place of the job's gradient_clipping: pass --ds-config with "
                  "the job's config to write its value", stacklevel=2)
    return 0.0


def source_dtype(src: CheckpointSource) -> torch.dtype:
    """The precision the source trained in: zeroshard records it; DeepSpeed's ``bf16_`` prefix says bf16."""
    meta = getattr(src, "meta", None)
    if meta is not None:
        return getattr(torch, str(meta.compute_dtype))
    if src.format == "deepspeed" and any(src.path.glob("bf16_zero_pp_rank_*_optim_states.pt")):
        return torch.bfloat16
    return torch.float32


@dataclass
class _Member:
    """A trained parameter's place in its param group's flat buffer."""

    name: str
    offset: int
    numel: int


def _groups(src: CheckpointSource) -> list[list[_Member]]:
    if not src.params:
        raise CheckpointError(f"{src.path}: the checkpoint has no trained parameters to write")
    count = 1 + max(p.group for p in src.params.values())
    groups: list[list[_Member]] = [[] for _ in range(count)]
    for p in src.params.values():
        group = groups[p.group]
        offset = group[-1].offset + group[-1].numel if group else 0
        group.append(_Member(p.name, offset, p.numel))
    empty = [g for g, members in enumerate(groups) if not members]
    if empty:
        raise CheckpointError(f"{src.path}: param groups {empty} have no trained parameters; DeepSpeed "
                              "cannot hold an empty param group")
    return groups


def partition_size_12(group_numel: int, world: int) -> int:
    """Stages 1–2: elements per rank partition (the group padded to a multiple of ``2 * world``)."""
    align = 2 * world
    return math.ceil(group_numel / align) * align // world


def sub_groups_3(chunks: list[int], sub_group_size: int) -> list[list[int]]:
    """Stage 3: indices of a group's parameters per sub-group, as ``_create_fp16_sub_groups`` cuts
    them (a sub-group closes once its per-rank elements reach ``sub_group_size``)."""
    if sub_group_size >= sum(chunks):
        return [list(range(len(chunks)))]
    out: list[list[int]] = [[]]
    size = 0
    for i, c in enumerate(chunks):
        out[-1].append(i)
        size += c
        if size >= sub_group_size and i != len(chunks) - 1:
            out.append([])
            size = 0
    return out


def _fill(src: CheckpointSource, key: str, pieces: list[tuple[str, int, int, int]], size: int) -> torch.Tensor:
    """An fp32 buffer of ``size`` zeros with ``(name, lo, hi, at)`` ranges of ``key`` copied in."""
    out = torch.zeros(size, dtype=torch.float32)
    for name, lo, hi, at in pieces:
        src.read(key, name, lo, hi, out=out[at : at + hi - lo])
    return out


def _state_keys(src: CheckpointSource, names: list[str]) -> tuple[list[str], list[str]]:
    """Elementwise and scalar optimizer-state keys, which every parameter of a flat group must share."""
    kinds = {n: src.params[n].state for n in names}
    first = kinds[names[0]]
    for n, k in kinds.items():
        if k != first:
            raise CheckpointError(f"{src.path}: parameters {names[0]!r} and {n!r} share a DeepSpeed flat group but "
                                  f"have different optimizer state ({sorted(first)} vs {sorted(k)})")
    return [k for k, v in first.items() if v == SHARDED], [k for k, v in first.items() if v != SHARDED]


def _scalar(src: CheckpointSource, key: str, name: str) -> Any:
    value = src.read_scalar(key, name)
    number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    if key == "step":  # FusedAdam and DeepSpeedCPUAdam count in a Python int; torch's Adam converts it
        return int(round(float(number)))
    return value


def _opt_state(src: CheckpointSource, names: list[str], pieces: list[tuple[str, int, int, int]],
               size: int) -> dict[str, Any]:
    sharded, _scalars = _state_keys(src, names)
    return {k: _fill(src, k, pieces, size) if k in sharded else _scalar(src, k, names[0])
            for k in src.params[names[0]].state}


def _group_options(src: CheckpointSource, count: int) -> list[dict[str, Any]]:
    groups = src.param_groups
    if not groups or len(groups) != count:
        raise CheckpointError(f"{src.path}: expected the options of {count} optimizer param groups, found "
                              f"{0 if not groups else len(groups)}; cannot write DeepSpeed's optimizer state")
    out = []
    for g in groups:
        opts = {k: v for k, v in g.items() if k not in ("params", "param_names")}
        opts.setdefault("bias_correction", True)  # FusedAdam and DeepSpeedCPUAdam read it
        out.append(opts)
    return out


def _loss_scaler(src: CheckpointSource, target: DeepSpeedTarget) -> tuple[ds_pickle.DeepSpeedObject, bool]:
    """DeepSpeed's scaler object (its loader adopts it whole): static at scale 1 for fp32/bf16; for
    fp16 as the target config says, continuing the source's dynamic scaler when it had one."""
    fp16 = (target.ds_config or {}).get("fp16") or {}
    static = float(fp16.get("loss_scale", 0))
    if target.dtype != torch.float16 or static > 0:
        return ds_pickle.DeepSpeedObject(ds_pickle.LOSS_SCALER, {"cur_scale": static or 1.0, "dynamic": False}), False
    saved = src.loss_scaler if src.loss_scaler and src.loss_scaler.get("dynamic") else {}
    hysteresis = int(fp16.get("hysteresis", 2))
    state = {"cur_scale": float(saved.get("scale", 2.0 ** float(fp16.get("initial_scale_power", 16)))),
             "dynamic": True, "cur_iter": int(saved.get("cur_iter", 0)),
             "last_overflow_iter": int(saved.get("last_overflow_iter", -1)),
             "scale_factor": 2.0, "scale_window": int(fp16.get("loss_scale_window", 1000)),
             "min_scale": float(fp16.get("min_loss_scale", 1)), "delayed_shift": hysteresis,
             "cur_hysteresis": int(saved.get("cur_hysteresis", hysteresis)),
             "consecutive_hysteresis": bool(fp16.get("consecutive_hysteresis", False)),
             "raise_error_at_min_scale": True, "dtype": torch.float16}
    return ds_pickle.DeepSpeedObject(ds_pickle.DYNAMIC_LOSS_SCALER, state), True


def _fragment(numel: int, start: int) -> ds_pickle.DeepSpeedObject:
    return ds_pickle.DeepSpeedObject(("deepspeed.utils.tensor_fragment", "fragment_address"), call_args=(numel, start))


def _optim_12(src: CheckpointSource, groups: list[list[_Member]], target: DeepSpeedTarget, rank: int,
              common: dict[str, Any]) -> dict[str, Any]:
    world = target.world_size
    parts, paddings, mappings, state, opts = [], [], [], {}, _group_options(src, len(groups))
    for g, members in enumerate(groups):
        numel = members[-1].offset + members[-1].numel
        size = partition_size_12(numel, world)
        start = rank * size
        pieces = [(m.name, max(start, m.offset) - m.offset, min(start + size, m.offset + m.numel) - m.offset,
                   max(start, m.offset) - start)
                  for m in members if m.offset < start + size and start < m.offset + m.numel]
        lean = max(0, min(size, numel - start))
        parts.append(_fill(src, MASTER, pieces, size)[:lean].clone())  # a view would save the padding too
        paddings.append(size - lean)
        mappings.append(OrderedDict((n, _fragment(hi - lo, at)) for n, lo, hi, at in pieces))
        state[g] = _opt_state(src, [m.name for m in members], pieces, size)
    groups_state = [{**o, "params": [g]} for g, o in enumerate(opts)]  # one flat parameter per group
    return {**common, "clip_grad": clipping(target, src),
            "base_optimizer_state": {"state": state, "param_groups": groups_state},
            "single_partition_of_fp32_groups": parts, "zero_stage": ds_pickle.zero_stage(target.stage),
            "group_paddings": paddings, "param_alignment_paddings": [[0] * len(m) for m in groups],
            "partition_count": [world] * len(groups), "ds_version": DS_VERSION, "param_slice_mappings": mappings}


def _optim_3(src: CheckpointSource, groups: list[list[_Member]], target: DeepSpeedTarget, rank: int,
             common: dict[str, Any]) -> dict[str, Any]:
    world = target.world_size
    flats: list[torch.Tensor] = []
    params_of: list[list[int]] = []
    state: dict[int, Any] = {}
    opts = _group_options(src, len(groups))
    for members in groups:
        chunks = [math.ceil(m.numel / world) for m in members]
        params_of.append([])
        for sub in sub_groups_3(chunks, target.sub_group_size):
            pieces, at = [], 0
            for i in sub:
                m, c = members[i], chunks[i]
                lo, hi = min(rank * c, m.numel), min((rank + 1) * c, m.numel)
                if lo < hi:
                    pieces.append((m.name, lo, hi, at))
                at += c
            params_of[-1].append(len(flats))
            state[len(flats)] = _opt_state(src, [members[i].name for i in sub], pieces, at)
            flats.append(_fill(src, MASTER, pieces, at))
    return {"zero_stage": ds_pickle.zero_stage(3), **common, "partition_count": world,
            "optimizer_state_dict": {"state": state,
                                     "param_groups": [{**o, "params": params_of[g]} for g, o in enumerate(opts)]},
            "fp32_flat_groups": flats}


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


def _model_states(src: CheckpointSource, groups: list[list[_Member]], target: DeepSpeedTarget,
                  rank: int) -> dict[str, Any]:
    dtype, stage, world = target.dtype, target.stage, target.world_size
    extras = {n: src.read_extra(n) for n in (*src.buffers, *src.frozen)}
    values: dict[str, torch.Tensor] = {}
    for name in src.module_keys:
        key = src.aliases.get(name, name)
        if key in values:
            values[name] = values[key]  # a tied parameter: one tensor under both names, as state_dict()
        elif key in src.buffers:
            values[name] = _cast(extras[key], dtype)
        elif key in src.params or key in src.frozen:
            values[name] = (torch.empty(0, dtype=dtype) if stage == 3 else
                            _cast(src.read_full(key), dtype) if key in src.params else _cast(extras[key], dtype))
    frozen_shapes = OrderedDict((n, extras[n].shape) for n in src.frozen)
    fragments: OrderedDict[str, torch.Tensor] = OrderedDict()
    for n in src.frozen:  # stage 3 keeps each rank's padded chunk of a frozen parameter (its ds_tensor)
        t = _cast(extras[n], dtype).reshape(-1)
        if stage == 3:
            c = math.ceil(t.numel() / world)
            t = torch.cat([t, t.new_zeros(c * world - t.numel())])[rank * c : (rank + 1) * c]
        fragments[n] = t.clone() if stage == 3 else t.view(extras[n].shape)
    client = {k: v for k, v in src.client_state.items() if k not in _RESERVED}
    counters = src.counters
    return {
        "module": OrderedDict(values), "buffer_names": list(src.buffers), "optimizer": None,
        "param_shapes": [OrderedDict((m.name, torch.Size(src.params[m.name].shape)) for m in members)
                         for members in groups],
        "frozen_param_shapes": frozen_shapes if stage >= 2 else None,
        "shared_params": dict(src.aliases), "frozen_param_fragments": fragments if stage >= 2 else None,
        "lr_scheduler": src.lr_scheduler, "data_sampler": None, "random_ltd": None,
        "skipped_steps": int(counters.get("skipped_steps", 0)), "global_steps": int(counters.get("global_steps", 0)),
        "global_samples": int(counters.get("global_samples", 0)), "dp_world_size": world, "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": target.ds_config or {}, "ds_version": DS_VERSION, **client,
    }


def write_tag_dir(src: CheckpointSource, out: Path, target: DeepSpeedTarget,
                  progress: Callable[[int, int, str], None] | None = None) -> list[Path]:
    """Write the DeepSpeed files of one tag into the existing, empty directory ``out``."""
    groups = _groups(src)
    world, stage = target.world_size, target.stage
    scaler, dynamic = _loss_scaler(src, target)
    common = {"loss_scaler": scaler, "dynamic_loss_scale": dynamic, "overflow": False}
    prefix = "bf16_" if target.dtype == torch.bfloat16 else ""
    written = []
    total = world * (2 if stage == 3 else 1) + (0 if stage == 3 else 1)
    for rank in range(world):
        build = _optim_3 if stage == 3 else _optim_12
        osd = build(src, groups, target, rank, common)
        path = out / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        ds_pickle.save({"optimizer_state_dict": osd, "ds_config": target.ds_config or {}, "ds_version": DS_VERSION},
                       path)
        written.append(path)
        if progress is not None:
            progress(len(written), total, path.name)
        if stage == 3 or rank == 0:
            name = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
            ds_pickle.save(_model_states(src, groups, target, rank), out / name)
            written.append(out / name)
            if progress is not None:
                progress(len(written), total, name)
    return written


def write_deepspeed_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, target: DeepSpeedTarget,
                               tag: str | None = None, out_tag: str | None = None,
                               progress: Callable[[int, int, str], None] | None = None) -> Path:
    """Write ``checkpoint_dir`` (tag ``tag``, default ``latest``) as DeepSpeed's ``out_dir/<out_tag>``.

    ``out_tag`` defaults to the source's tag. The tag directory is written under a temporary name
    and renamed when complete; then ``out_dir/latest`` names it. Returns the tag directory.

    Raises:
        CheckpointError: the source cannot be read, or does not fit DeepSpeed's layout (see the message).
    """
    path = resolve_checkpoint(checkpoint_dir, tag)
    if path is None:
        raise CheckpointError(f"{checkpoint_dir} has no 'latest' file; pass the tag (a subdirectory) explicitly")
    out_root = Path(out_dir)
    name = out_tag or path.name
    if not plain_name(name) or name == LATEST_FILE:
        raise CheckpointError(f"invalid DeepSpeed tag {name!r} for {out_root}: use a plain name such as "
                              "'global_step100'")
    final = out_root / name
    if final.exists():
        raise CheckpointError(f"{final} already exists; remove it or choose another output directory")
    out_root.mkdir(parents=True, exist_ok=True)
    tmp = out_root / f".tmp-{name}-{new_nonce()}"
    tmp.mkdir()
    try:
        with open_source(path) as src:
            write_tag_dir(src, tmp, target, progress)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (out_root / LATEST_FILE).write_text(name)
    logger.info("wrote DeepSpeed checkpoint %s (stage %d, %d ranks, %s)", final, target.stage, target.world_size,
                str(target.dtype).replace("torch.", ""))
    return final


def load_ds_config(path: str | Path) -> dict[str, Any]:
    """A DeepSpeed JSON config file, as a dict (errors name the file)."""
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read DeepSpeed config {path}: {e}") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"DeepSpeed config {path} is not a JSON object")
    return cfg
