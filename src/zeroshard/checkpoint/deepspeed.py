"""DeepSpeed 0.19 ZeRO checkpoints (stages 1, 2, 3; fp32/bf16/fp16), read without DeepSpeed.

Files of a tag directory, as ``DeepSpeedEngine.save_checkpoint`` writes them:

- ``mp_rank_00_model_states.pt`` (stages 1–2) or ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``
  (stage 3, one per rank): the module state dict (16-bit weights; empty placeholders at stage 3),
  ``param_shapes`` (an ordered name -> shape dict per group, in flat-buffer order), buffer names,
  frozen parameters, ``shared_params``, the scheduler state, step counters and client keys.
- ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``, one per rank: the rank's fp32 partition
  and the torch optimizer's state over it.

Flat layouts (what :class:`DeepSpeedSource` maps to per-parameter pieces):

- stages 1–2: each param group's parameters are concatenated (with ``param_alignment_paddings``
  after each, when present), padded, and cut into equal partitions; rank ``r`` saves its
  partition with the tail padding removed (``single_partition_of_fp32_groups``; the BF16
  optimizer saves it padded, with ``group_paddings``), and optimizer state over the padded
  partition (``base_optimizer_state``).
- stage 3: every parameter is split into ``ceil(numel / world)`` chunks, rank ``r`` holding chunk
  ``r``; the rank's chunks of all parameters, in ``param_shapes`` order, are concatenated into its
  ``fp32_flat_groups`` (optimizer state alike).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from zeroshard.checkpoint.collect import SCALAR, SHARDED
from zeroshard.checkpoint.source import MASTER, CheckpointSource, SourceParam, fill_range
from zeroshard.checkpoint.unpickle import InertRecord, LazyTensor, load_restricted, materialize
from zeroshard.errors import CheckpointError, ZeroshardError

_OPTIM = re.compile(r"^(?:(bf16|fp16)_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
#: Keys DeepSpeed itself puts in the model-states file (not returned as client state on load).
_DS_KEYS = {"module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler",
            "random_ltd", "lr_scheduler", "optimizer"}
_Handle = tuple[int, int, int]  # (rank, flat group, offset of the piece's first element in that group)
_Method = TypeVar("_Method", bound=Callable[..., Any])


def _readable(method: _Method) -> _Method:
    """Turn what a malformed (damaged or forged) DeepSpeed structure makes ``method`` raise into a
    :class:`CheckpointError` naming the checkpoint: the files are pickles of whatever DeepSpeed's
    version wrote, so their shape is checked where it is used, not by a schema."""

    @functools.wraps(method)
    def checked(self: DeepSpeedSource, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except ZeroshardError:
            raise
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError, RuntimeError) as e:
            raise CheckpointError(f"{self.path} is not a DeepSpeed ZeRO checkpoint that zeroshard can read: "
                                  f"{type(e).__name__}: {e}") from e

    return cast(_Method, checked)


def _int(value: Any) -> int:
    if isinstance(value, InertRecord):  # ZeroStageEnum(2) arrives as a record of its call
        return int(value.args[0])
    return int(value)


def _optim_files(path: Path) -> list[Path]:
    found: dict[str, dict[int, Path]] = {}
    for f in path.iterdir():
        m = _OPTIM.match(f.name)
        if m:
            if m.group(3) != "00":
                raise CheckpointError(f"{f}: model-parallel DeepSpeed checkpoints (mp_rank > 0) are not supported")
            found.setdefault(m.group(1) or "", {})[int(m.group(2))] = f
    if len(found) != 1:
        raise CheckpointError(f"{path}: expected one set of *zero_pp_rank_N_mp_rank_00_optim_states.pt files, "
                              f"found {len(found)} ({sorted(found)})")
    ranks = next(iter(found.values()))
    if sorted(ranks) != list(range(len(ranks))):
        raise CheckpointError(f"{path}: optimizer files for ranks {sorted(ranks)}; some rank's file is missing")
    return [ranks[r] for r in range(len(ranks))]


class DeepSpeedSource(CheckpointSource):
    """A DeepSpeed ZeRO tag directory presented as a :class:`CheckpointSource`."""

    format = "deepspeed"

    @_readable
    def __init__(self, path: Path) -> None:
        self.path = path
        optim_files = _optim_files(path)
        self._optim_paths = optim_files
        self.world_size = len(optim_files)
        self._optims = [self._optim_dict(f) for f in optim_files]
        osd = self._optims[0]
        self.zero_stage = _int(osd["zero_stage"]) if "zero_stage" in osd else 1  # BF16_Optimizer: stage 1
        count = osd.get("partition_count", self.world_size)
        count = max(count) if isinstance(count, list) else int(count)
        if count != self.world_size:
            raise CheckpointError(f"{path}: saved by {count} ranks but has {self.world_size} optimizer files")
        model_name = "mp_rank_00_model_states.pt"
        if self.zero_stage == 3:
            model_name = "zero_pp_rank_0_mp_rank_00_model_states.pt"
        self._model_file = path / model_name
        if not self._model_file.is_file():
            raise CheckpointError(f"{path}: DeepSpeed model-states file {model_name} is missing")
        model = load_restricted(self._model_file)
        if not isinstance(model, dict) or "param_shapes" not in model:
            raise CheckpointError(f"{self._model_file} is not a DeepSpeed ZeRO model-states file")
        self._model = model
        shapes = model["param_shapes"]
        group_of = self._param_group_of_flat(osd, len(shapes))
        self.params = {n: SourceParam(n, tuple(int(d) for d in s), group_of[g]) for g, group in enumerate(shapes)
                       for n, s in group.items()}
        for p in self.params.values():
            if not all(0 <= d < 2**63 for d in p.shape):
                raise CheckpointError(f"{self._model_file}: parameter {p.name!r} has the shape {p.shape}")
        self._pieces = self._layout3(shapes) if self.zero_stage == 3 else self._layout12(shapes)
        self._states = [self._group_states(o) for o in self._optims]
        kinds = {k: SHARDED if isinstance(v, LazyTensor) and v.dim() > 0 else SCALAR
                 for st in self._states[0] for k, v in st.items()}
        for p in self.params.values():
            p.state = dict(kinds)
        self.module_keys = list(model["module"].keys())
        self.aliases = {str(k): str(v) for k, v in (model.get("shared_params") or {}).items()}
        self.buffers = list(model.get("buffer_names") or [])
        self.frozen = list((model.get("frozen_param_shapes") or {}).keys())
        if self.zero_stage < 3:  # the module state dict holds every weight in full: untrained ones too
            known = set(self.params) | set(self.buffers) | set(self.aliases) | set(self.frozen)
            self.frozen += [k for k in self.module_keys if k not in known]
        self._rank_models: list[dict[str, Any]] | None = None
        self.param_groups = self._param_groups(osd)
        self.lr_scheduler = materialize(model.get("lr_scheduler"))
        self.loss_scaler = self._scaler(osd)
        clip = osd.get("clip_grad")  # stages 1-2 record it; DeepSpeed's load adopts it
        self.gradient_clipping = float(clip) if isinstance(clip, (int, float)) and not isinstance(clip, bool) else None
        self.counters = {k: int(model[k]) for k in ("global_steps", "global_samples", "skipped_steps") if k in model}
        self.dataloader = None
        self.client_state = {k: materialize(v) for k, v in model.items() if k not in _DS_KEYS}

    def _optim_dict(self, f: Path) -> dict[str, Any]:
        raw = load_restricted(f)
        if not isinstance(raw, dict) or not isinstance(raw.get("optimizer_state_dict"), dict):
            raise CheckpointError(f"{f} is not a DeepSpeed ZeRO optimizer-states file")
        return raw["optimizer_state_dict"]

    def _flat(self, rank: int) -> list[LazyTensor]:
        key = "fp32_flat_groups" if self.zero_stage == 3 else "single_partition_of_fp32_groups"
        groups = self._optims[rank].get(key)
        if not isinstance(groups, list):
            raise CheckpointError(f"{self._optim_paths[rank]}: expected a list of flat fp32 partitions under "
                                  f"optimizer_state_dict[{key!r}] (DeepSpeed 0.19's ZeRO-{self.zero_stage} layout)")
        return groups

    def _layout12(self, shapes: list[dict[str, Any]]) -> dict[str, list[tuple[int, int, _Handle]]]:
        pieces: dict[str, list[tuple[int, int, _Handle]]] = {}
        trimmed = "zero_stage" in self._optims[0]  # ZeRO saves partitions without tail padding
        for g, group in enumerate(shapes):
            starts, lengths, pos = [], [], 0
            for r in range(self.world_size):
                n = self._flat(r)[g].numel()
                if not trimmed:
                    n -= int(self._optims[r]["group_paddings"][g])
                starts.append(pos)
                lengths.append(n)
                pos += n
            pads = (self._optims[0].get("param_alignment_paddings") or [[0] * len(group)] * len(shapes))[g]
            off = 0
            for (name, _shape), pad in zip(group.items(), pads):
                numel = self.params[name].numel
                pieces[name] = []
                for r in range(self.world_size):
                    a, b = max(off, starts[r]), min(off + numel, starts[r] + lengths[r])
                    if a < b:
                        pieces[name].append((a - off, b - off, (r, g, a - starts[r])))
                off += numel + int(pad)
            if off > pos:
                raise CheckpointError(f"{self.path}: param group {g} needs {off} elements, the partitions hold {pos}")
        return pieces

    def _layout3(self, shapes: list[dict[str, Any]]) -> dict[str, list[tuple[int, int, _Handle]]]:
        sizes = [t.numel() for t in self._flat(0)]
        bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        pieces: dict[str, list[tuple[int, int, _Handle]]] = {}
        virt = 0
        for group in shapes:
            for name in group:
                numel = self.params[name].numel
                chunk = -(-numel // self.world_size)
                pieces[name] = []
                for r in range(self.world_size):
                    s, e = min(r * chunk, numel), min((r + 1) * chunk, numel)
                    for g in range(len(sizes)):  # a chunk may straddle two flat groups
                        lo, hi = max(virt + s - r * chunk, bounds[g]), min(virt + e - r * chunk, bounds[g + 1])
                        if lo < hi:
                            first = lo - virt + r * chunk
                            pieces[name].append((first, first + hi - lo, (r, g, lo - bounds[g])))
                virt += chunk
        if virt != bounds[-1]:
            raise CheckpointError(f"{self.path}: parameters need {virt} elements per rank, the flat groups hold "
                                  f"{bounds[-1]}")
        return pieces

    def _base_state(self, osd: dict[str, Any]) -> Any:
        return osd.get("optimizer_state_dict" if self.zero_stage == 3 else "base_optimizer_state")

    def _param_group_of_flat(self, osd: dict[str, Any], flat_count: int) -> list[int]:
        """The torch param group of each flat group. ZeRO-3 cuts a param group whose per-rank
        chunks exceed ``sub_group_size`` into sub-groups, each a flat parameter of that group
        (``param_groups[i]["params"]`` lists them); at stages 1-2 flat group ``g`` is param group ``g``."""
        base = self._base_state(osd)
        if not isinstance(base, dict) or not isinstance(base.get("param_groups"), list):
            return list(range(flat_count))
        owners = [i for i, group in enumerate(base["param_groups"]) for _ in group.get("params", [])]
        if len(owners) != flat_count:
            raise CheckpointError(f"{self.path}: the optimizer's param groups hold {len(owners)} flat parameters, "
                                  f"the model states list {flat_count} groups of parameter shapes")
        return owners

    def _group_states(self, osd: dict[str, Any]) -> list[dict[str, Any]]:
        """Per flat group: the torch optimizer state of its flat parameter, in the order of the
        param groups' ``params`` (several per param group with ZeRO-3 sub-groups)."""
        base = self._base_state(osd)
        if isinstance(base, list):  # elastic layout: one lean state dict per group, step kept aside
            step = osd.get("base_optimizer_state_step")
            return [{**st, **({"step": torch.tensor(float(step))} if step is not None else {})} for st in base]
        if not isinstance(base, dict) or "state" not in base:
            return []
        return [dict(base["state"].get(idx, {})) for group in base.get("param_groups", [])
                for idx in group.get("params", [])]

    def _param_groups(self, osd: dict[str, Any]) -> list[dict[str, Any]] | None:
        base = self._base_state(osd)
        if not isinstance(base, dict):
            return None
        return [{k: materialize(v) for k, v in g.items() if k != "params"} for g in base.get("param_groups", [])]

    def _scaler(self, osd: dict[str, Any]) -> dict[str, Any] | None:
        rec = osd.get("loss_scaler")
        if not isinstance(rec, InertRecord):
            return None
        try:
            if not bool(osd.get("dynamic_loss_scale", False)):
                return {"dynamic": False, "scale": float(rec.cur_scale)}
            return {"dynamic": True, "scale": float(rec.cur_scale), "cur_iter": int(rec.cur_iter),
                    "last_overflow_iter": int(rec.last_overflow_iter), "cur_hysteresis": int(rec.cur_hysteresis)}
        except AttributeError as e:
            raise CheckpointError(f"{self.path}: unrecognised DeepSpeed loss scaler record: {e}") from e

    def _tensor(self, key: str, rank: int, group: int) -> LazyTensor:
        if key == MASTER:
            return self._flat(rank)[group]
        try:
            value = self._states[rank][group][key]
        except (IndexError, KeyError) as e:
            raise CheckpointError(f"{self._optim_paths[rank]}: no optimizer state {key!r} for flat group {group} "
                                  "(expected the torch optimizer's state_dict over each flat group)") from e
        if not isinstance(value, LazyTensor):
            raise CheckpointError(f"{self.path}: optimizer state {key!r} is not a tensor")
        return value

    @_readable
    def read(self, key: str, name: str, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of a parameter's fp32 master or sharded optimizer state."""
        pieces = self._pieces[name]
        dtype = self._tensor(key, *pieces[0][2][:2]).dtype if pieces else torch.float32

        def copy(handle: _Handle, a: int, b: int, dst: torch.Tensor) -> None:
            r, g, off = handle
            start = next(s for s, _e, h in pieces if h == handle)
            self._tensor(key, r, g).read(off + a - start, off + b - start, out=dst)

        return fill_range(pieces, lo, hi, dtype, out, copy, f"{self.path}: {key} of {name}")

    @_readable
    def read_scalar(self, key: str, name: str) -> Any:
        """Per-group scalar state (Adam's ``step``), from the first rank holding the parameter.

        DeepSpeed's default optimizers (FusedAdam, DeepSpeedCPUAdam) keep ``step`` as a Python int,
        ``torch_adam`` as a tensor; zeroshard steps with torch optimizers, which want a tensor."""
        r, g, _ = self._pieces[name][0][2]
        value = self._states[r][g][key]
        if isinstance(value, LazyTensor):
            return value.load()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(f"{self.path}: optimizer state {key!r} of rank {r} is a {type(value).__name__}, "
                                  "expected a tensor or a number")
        return torch.tensor(float(value), dtype=torch.float32)

    @_readable
    def read_extra(self, name: str) -> torch.Tensor:
        """A buffer or an untrained parameter: from the module state dict (stages 1–2) or from every
        rank's ``frozen_param_fragments`` (stage 3)."""
        module = self._model["module"]
        if name in self.buffers or (name in self.frozen and self.zero_stage < 3):
            frags = self._model.get("frozen_param_fragments") or {}
            value = materialize(frags[name] if name in frags else module[name])
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"{self._model_file}: {name!r} is a {type(value).__name__}, not a tensor")
            return value
        if name not in self.frozen:
            raise CheckpointError(f"{self._model_file} has no buffer or frozen parameter {name!r}")
        if self._rank_models is None:
            self._rank_models = [load_restricted(self.path / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
                                 for r in range(self.world_size)]
        shape = tuple(int(d) for d in self._model["frozen_param_shapes"][name])
        frags = [materialize(m["frozen_param_fragments"][name]).reshape(-1) for m in self._rank_models]
        return torch.cat(frags)[: math.prod(shape)].view(shape)
