"""Fuzzed configs: whatever a config file, JSON string or dict holds, loading it (and building its
optimizer and LR schedule, as ``initialize`` does) either succeeds or raises one of zeroshard's own
errors whose message names the key or the file; never a TypeError, RecursionError or pydantic error
from deep inside.

Configs are valid DeepSpeed configs drawn by hypothesis and then damaged: values replaced by wrong
types, negative, huge or non-finite numbers and nested garbage, keys deleted or invented; as text they
are truncated, spliced with random bytes (including non-UTF-8) or nested thousands of levels deep;
as paths they are missing, directories, or contain NUL bytes.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from zeroshard.config import BATCH_KEYS, load_config, to_dict
from zeroshard.errors import ConfigError, ZeroshardError
from zeroshard.optim import build_optimizer, build_scheduler

SCALE = float(os.environ.get("ZEROSHARD_FUZZ_SCALE", "1"))  # more examples for a longer search
FUZZ = settings(max_examples=int(200 * SCALE), deadline=None,
                # CI (CI=true) replays the same examples every run; elsewhere each run explores anew
                derandomize=bool(os.environ.get("CI")),
                suppress_health_check=[HealthCheck.function_scoped_fixture])
WORLD = 2

# ------------------------------------------------------------------------------------------ strategies

NASTY_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 3, 2**31, 2**63, 10**30, -(10**30), 10**400, 0.5, -0.0, 1e-320, 1e308, -1e308,
    math.nan, math.inf, -math.inf, "", "auto", "none", "32", "fp16", "Adam", "\x00", "\ud800", "é" * 3,
    [], {}, [1, 2], [0.9], [0.9, 2.0], {"enabled": True}, {"a": {"b": None}}, {"type": "Adam"},
]
"""Values a careless (or hostile) config might hold."""

json_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8), st.sampled_from(NASTY_VALUES)
)
garbage = st.recursive(
    json_leaves,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
# What only a Python dict (not JSON) can hold.
python_only = st.sampled_from([b"1", (0.9, 0.99), {1, 2}, object(), torch.tensor(1.0), 1 + 2j, {1: "a"}, Path("x")])

OPTIMIZERS = {
    "Adam": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "adam_w_mode": True},
    "AdamW": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1, "torch_adam": True},
    "SGD": {"lr": 0.1, "momentum": 0.9, "nesterov": True},
    "Adagrad": {"lr": 0.01, "lr_decay": 0.0, "eps": 1e-10},
    "Lion": {"lr": 1e-4, "betas": [0.9, 0.99], "weight_decay": 0.0},
}
SCHEDULERS = {
    "WarmupLR": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10, "warmup_type": "log"},
    "WarmupDecayLR": {"total_num_steps": 100, "warmup_max_lr": 1e-3, "warmup_num_steps": 10},
    "WarmupCosineLR": {"total_num_steps": 100, "warmup_num_steps": 5, "cos_min_ratio": 0.1},
    "OneCycle": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 10},
    "LRRangeTest": {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 10},
}


@st.composite
def valid_configs(draw: st.DrawFn) -> dict[str, Any]:
    """A valid DeepSpeed config for ``WORLD`` ranks (that loads without error)."""
    micro, gas = draw(st.integers(1, 8)), draw(st.integers(1, 4))
    batch = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
             "train_batch_size": micro * gas * WORLD}
    keep = draw(st.sampled_from([BATCH_KEYS, BATCH_KEYS[:2], BATCH_KEYS[1:], BATCH_KEYS[:1], BATCH_KEYS[1:2]]))
    cfg: dict[str, Any] = {k: batch[k] for k in keep}
    precision = draw(st.sampled_from(["fp32", "bf16", "fp16"]))
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": draw(st.sampled_from([0, 128.0])), "initial_scale_power": 12,
                       "loss_scale_window": 100, "hysteresis": 2, "min_loss_scale": 1}
    elif precision == "bf16":
        cfg[draw(st.sampled_from(["bf16", "bfloat16"]))] = {"enabled": True}
    cfg["zero_optimization"] = {
        "stage": draw(st.integers(0, 3)),
        "reduce_bucket_size": draw(st.sampled_from([5e7, 500_000_000, 1000, "auto"])),
        "allgather_bucket_size": draw(st.sampled_from([2e8, 1000])),
        "overlap_comm": draw(st.booleans()),
        "contiguous_gradients": True,
        "stage3_max_live_parameters": draw(st.sampled_from([1e9, "auto"])),
        "offload_optimizer": {"device": "none"},
    }
    if draw(st.booleans()):
        cfg["gradient_clipping"] = draw(st.sampled_from([0, 1.0, 0.5]))
    if draw(st.booleans()):
        cfg["data_types"] = {"grad_accum_dtype": draw(st.sampled_from(["fp32", "float32", "torch.bfloat16"]))}
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(OPTIMIZERS)))
        cfg["optimizer"] = {"type": draw(st.sampled_from([name, name.lower(), name.upper()])),
                            "params": dict(OPTIMIZERS[name])}
        if draw(st.booleans()):
            sched = draw(st.sampled_from(sorted(SCHEDULERS)))
            cfg["scheduler"] = {"type": sched, "params": dict(SCHEDULERS[sched])}
    if draw(st.booleans()):
        cfg["steps_per_print"] = 10
        cfg["wall_clock_breakdown"] = False
        cfg["checkpoint"] = {"tag_validation": "warn"}
        cfg["sparse_gradients"] = False  # a DeepSpeed-only key at its harmless value
    return cfg


def _paths(node: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every key path of a nested dict (lists are leaves)."""
    out = []
    if isinstance(node, dict):
        for key, value in node.items():
            out.append((*prefix, key))
            out.extend(_paths(value, (*prefix, key)))
    return out


def _parent(cfg: dict[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = cfg
    for part in path[:-1]:
        node = node[part]
    return node


@st.composite
def damaged_configs(draw: st.DrawFn, values: st.SearchStrategy[Any] = garbage) -> dict[str, Any]:
    """A valid config with one to three edits: a value replaced, a key deleted, a key invented."""
    cfg = draw(valid_configs())
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(cfg)
        op = draw(st.sampled_from(["replace", "delete", "invent"]))
        if op == "invent" or not paths:
            dicts = [()] + [p for p in paths if isinstance(_parent(cfg, p)[p[-1]], dict)]
            where = draw(st.sampled_from(dicts))
            node = _parent(cfg, (*where, "")) if where else cfg
            node[draw(st.sampled_from(["stage", "enabled", "lr", "zero_optimisation", "bogus", "", "a.b"]))] = \
                copy.deepcopy(draw(values))  # a fresh copy: later edits must not change the strategy's values
            continue
        path = draw(st.sampled_from(paths))
        if op == "delete":
            del _parent(cfg, path)[path[-1]]
        else:
            _parent(cfg, path)[path[-1]] = copy.deepcopy(draw(values))
    return cfg


# ------------------------------------------------------------------------------------------ checks

KEY_WORDS = (*BATCH_KEYS, "world_size", "fp16", "bf16", "zero_optimization", "optimizer", "scheduler", "auto_values")


def check_clear(error: BaseException, *, names: str | None = None) -> None:
    """``error`` is one of zeroshard's, with a message naming a key (or ``names``: the file)."""
    assert isinstance(error, ZeroshardError), f"{type(error).__name__} escaped: {error!r}"
    message = str(error)
    assert message and "Traceback" not in message
    if names is not None and names in message:
        return
    if isinstance(error, ConfigError) and error.key or message.startswith("unknown key ") or "key ''" in message:
        return
    assert any(word in message for word in KEY_WORDS), f"message names no key: {message!r}"


def load_or_error(source: Any, *, names: str | None = None, world: int = WORLD, **kwargs: Any) -> Any:
    """Load ``source``; returns the config, or None after checking the error is a clear one."""
    try:
        return load_config(source, world, **kwargs)
    except Exception as error:  # noqa: BLE001 - the check is what this test is about
        check_clear(error, names=names)
        return None


def build_like_initialize(cfg: Any) -> None:
    """What ``initialize`` builds from a loaded config without a process group: optimizer, schedule."""
    if cfg.optimizer is None:
        return
    params = [torch.nn.Parameter(torch.zeros(3))]
    try:
        opt = build_optimizer(cfg.optimizer.type, dict(cfg.optimizer.params), [{"params": params}])
        if cfg.scheduler is not None:
            sched = build_scheduler(cfg.scheduler.type, dict(cfg.scheduler.params), opt)
            for _ in range(3):
                sched.step()
    except Exception as error:  # noqa: BLE001
        check_clear(error)


# ------------------------------------------------------------------------------------------ tests


@FUZZ
@given(valid_configs())
def test_valid_configs_load_and_round_trip(raw: dict[str, Any]) -> None:
    cfg = load_config(raw, WORLD)
    assert cfg.train_batch_size == cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * WORLD
    again = load_config(to_dict(cfg), WORLD)
    assert to_dict(again) == to_dict(cfg)
    build_like_initialize(cfg)


@FUZZ
@given(damaged_configs(), st.sampled_from(["dict", "json"]))
def test_damaged_configs_fail_clearly(raw: dict[str, Any], form: str) -> None:
    source = raw if form == "dict" else json.dumps(raw)  # NaN/Infinity become JSON's non-standard tokens
    snapshot = json.dumps(raw, sort_keys=True)
    cfg = load_or_error(source)
    assert json.dumps(raw, sort_keys=True) == snapshot, "load_config modified the caller's dict"
    if cfg is not None:
        build_like_initialize(cfg)


@settings(FUZZ, max_examples=int(100 * SCALE))
@given(damaged_configs(values=python_only | garbage))
@example({"train_batch_size": 2, "": {1: "a"}})  # found by this test: the empty key went unnamed
def test_python_only_values_fail_clearly(raw: dict[str, Any]) -> None:
    cfg = load_or_error(raw)
    if cfg is not None:
        build_like_initialize(cfg)


@settings(FUZZ, max_examples=int(150 * SCALE))
@given(valid_configs(), st.sampled_from(["optimizer", "scheduler"]),
       st.dictionaries(st.sampled_from(sorted({k for p in (*OPTIMIZERS.values(), *SCHEDULERS.values()) for k in p}))
                       | st.text(max_size=12), garbage | python_only, max_size=4))
@example({"train_micro_batch_size_per_gpu": 1}, "optimizer", {"lr": object()})
def test_fuzzed_optimizer_and_scheduler_params(raw: dict[str, Any], block: str, params: dict[str, Any]) -> None:
    raw.setdefault("optimizer", {"type": "AdamW", "params": {}})
    raw.setdefault("scheduler", {"type": "WarmupLR", "params": {}})
    raw[block]["params"].update(params)
    cfg = load_or_error(raw)
    if cfg is not None:
        build_like_initialize(cfg)


@settings(FUZZ, max_examples=int(100 * SCALE))
@given(valid_configs(), st.data())
def test_damaged_json_files_name_the_file(tmp_path: Path, raw: dict[str, Any], data: st.DataObject) -> None:
    text = json.dumps(raw, indent=1).encode()
    edit = data.draw(st.sampled_from(["truncate", "splice", "bytes", "non-object", "deep"]))
    if edit == "truncate":
        text = text[: data.draw(st.integers(0, max(len(text) - 1, 0)))]
    elif edit == "splice":
        at = data.draw(st.integers(0, len(text)))
        text = text[:at] + data.draw(st.binary(min_size=1, max_size=8)) + text[at:]
    elif edit == "bytes":
        text = data.draw(st.binary(max_size=64))
    elif edit == "non-object":
        text = json.dumps(data.draw(garbage)).encode()
    else:
        depth = data.draw(st.sampled_from([50, 1000, 100_000]))
        text = b'{"optimizer": {"type": "Adam", "params": {"x": ' + b"[" * depth + b"]" * depth + b"}}}"
    path = tmp_path / "ds_config.json"
    path.write_bytes(text)
    load_or_error(path, names=str(path))
    load_or_error(str(path), names=str(path))
    try:
        as_string = text.decode()
    except UnicodeDecodeError:
        return
    if as_string.strip().startswith("{"):
        load_or_error(as_string, names="config JSON string")


@pytest.mark.parametrize("make", [
    lambda tmp: tmp / "missing.json",
    lambda tmp: tmp,  # a directory
    lambda tmp: str(tmp / "nul\x00byte.json"),
    lambda tmp: str(tmp / ("x" * 300 + ".json")),  # name too long for the file system
    lambda tmp: tmp / "missing_dir" / "ds.json",
], ids=["missing", "directory", "nul-byte", "name-too-long", "missing-dir"])
def test_bad_paths_name_the_file(tmp_path: Path, make: Any) -> None:
    path = make(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(path, 1)
    check_clear(info.value, names=repr(str(path))[1:-1])


@pytest.mark.parametrize("depth", [200, 5_000])
def test_deeply_nested_dict(depth: int) -> None:
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(depth):
        node["x"] = {}
        node = node["x"]
    for raw in ({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": deep}}, deep):
        with pytest.raises(ConfigError) as info:
            load_config(raw, 1)
        check_clear(info.value)


auto_keys = st.sampled_from(["optimizer.params.lr", "optimizer.params.betas", "train_batch_size",
                             "gradient_accumulation_steps", "zero_optimization.reduce_bucket_size", "bf16.enabled",
                             "", ".", "bogus", "optimizer.params", "zero_optimization..stage"]) | st.text(max_size=20)


@settings(FUZZ, max_examples=int(150 * SCALE))
@given(valid_configs(), st.dictionaries(auto_keys, garbage | python_only, max_size=3),
       st.one_of(st.integers(-2, 2**40), st.sampled_from([True, 2.0, "2", None])))
@example({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {}}},
         {"optimizer.params.lr": object()}, 1)
def test_fuzzed_auto_values_and_world_size(raw: dict[str, Any], auto_values: dict[str, Any], world: Any) -> None:
    if "optimizer" in raw:
        raw["optimizer"]["params"]["lr"] = "auto"
    for key in BATCH_KEYS:
        if key in raw and key in auto_values:
            raw[key] = "auto"
    load_or_error(raw, world=world, auto_values=auto_values)
