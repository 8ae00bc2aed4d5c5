"""Unit tests of ``zeroshard.optim``: optimizer factory semantics and LR schedules vs DeepSpeed's."""

from __future__ import annotations

import functools
import math
import types
from typing import Any

import pytest
import torch

from zeroshard.errors import ConfigError, NotYetSupportedError
from zeroshard.optim import (
    SUPPORTED_OPTIMIZERS,
    SUPPORTED_SCHEDULERS,
    Lion,
    build_optimizer,
    build_scheduler,
    implementation_flags,
)

STEPS = 300


# --------------------------------------------------------------------------------------------------
# helpers


def _params(seed: int = 0, n: int = 2) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(7, 5, generator=gen, dtype=torch.float64)) for _ in range(n)]


def _set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)


def _two_group_optimizer(kind: str) -> torch.optim.Optimizer:
    """An optimizer with two groups of different LRs (per-group scheduling must follow them)."""
    a, b = _params()
    groups = [{"params": [a], "lr": 1e-3}, {"params": [b], "lr": 4e-3}]
    if kind == "adam":
        return torch.optim.AdamW(groups, betas=(0.9, 0.999))
    return torch.optim.SGD(groups, momentum=0.9)


def _trace(sched: Any, opt: torch.optim.Optimizer, steps: int) -> list[tuple[float, ...]]:
    """LR (and beta1/beta2 when present) of every group after construction and after each step."""

    def snapshot() -> tuple[float, ...]:
        values: list[float] = []
        for group in opt.param_groups:
            values.append(float(group["lr"]))
            if "betas" in group:
                values.extend(float(b) for b in group["betas"])
        return tuple(values)

    out = [snapshot()]
    for _ in range(steps):
        sched.step()
        out.append(snapshot())
    return out


def _assert_same_sequence(ours: list[tuple[float, ...]], theirs: list[tuple[float, ...]]) -> None:
    assert len(ours) == len(theirs)
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for x, y in zip(a, b, strict=True):
            assert math.isclose(x, y, rel_tol=1e-12, abs_tol=0.0), f"step {index}: {a} != {b}"


@pytest.fixture(scope="module")
def ds_lr_schedules() -> types.ModuleType:
    return pytest.importorskip("deepspeed.runtime.lr_schedules")


SCHEDULE_CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("WarmupLR", "adam", {}),
    (
        "WarmupLR",
        "adam",
        {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-3, "warmup_num_steps": 100, "warmup_type": "linear"},
    ),
    ("WarmupLR", "sgd", {"warmup_max_lr": [1e-3, 2e-3], "warmup_num_steps": 50, "warmup_type": "log"}),
    ("WarmupLR", "adam", {"warmup_num_steps": 1, "warmup_max_lr": 0.01}),
    ("WarmupDecayLR", "adam", {"total_num_steps": 250}),
    (
        "WarmupDecayLR",
        "sgd",
        {
            "total_num_steps": 200,
            "warmup_num_steps": 30,
            "warmup_type": "linear",
            "warmup_min_lr": 1e-6,
            "warmup_max_lr": 5e-4,
        },
    ),
    ("WarmupDecayLR", "adam", {"total_num_steps": 20, "warmup_num_steps": 50}),
    ("WarmupCosineLR", "adam", {"total_num_steps": 250}),
    (
        "WarmupCosineLR",
        "sgd",
        {
            "total_num_steps": 200,
            "warmup_num_steps": 40,
            "warmup_type": "linear",
            "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.05,
        },
    ),
    ("WarmupCosineLR", "adam", {"total_num_steps": 10, "warmup_num_steps": 20}),
    ("OneCycle", "adam", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}),
    ("OneCycle", "adam", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 50}),
    (
        "OneCycle",
        "adam",
        {
            "cycle_min_lr": [1e-4, 2e-4],
            "cycle_max_lr": [1e-3, 3e-3],
            "cycle_first_step_size": 40,
            "cycle_second_step_size": 60,
            "decay_step_size": 10,
            "decay_lr_rate": 0.1,
            "decay_mom_rate": 0.05,
            "cycle_min_mom": 0.85,
            "cycle_max_mom": 0.95,
        },
    ),
    (
        "OneCycle",
        "adam",
        {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-3,
            "cycle_first_step_size": 60,
            "cycle_first_stair_count": 4,
            "cycle_second_step_size": 30,
            "cycle_second_stair_count": 3,
            "decay_step_size": 7,
            "decay_lr_rate": 0.5,
        },
    ),
    (
        "OneCycle",
        "adam",
        {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-3,
            "cycle_first_step_size": 25,
            "cycle_momentum": False,
            "decay_step_size": 5,
            "decay_lr_rate": 0.2,
        },
    ),
    ("OneCycle", "sgd", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 30}),
    ("LRRangeTest", "adam", {}),
    (
        "LRRangeTest",
        "sgd",
        {
            "lr_range_test_min_lr": [1e-4, 3e-4],
            "lr_range_test_step_size": 10,
            "lr_range_test_step_rate": 2.0,
            "lr_range_test_staircase": True,
        },
    ),
]


def _case_id(case: tuple[str, str, dict[str, Any]]) -> str:
    return f"{case[0]}-{case[1]}-{'-'.join(case[2]) or 'defaults'}"


# --------------------------------------------------------------------------------------------------
# schedules


def test_supported_schedulers_are_deepspeeds() -> None:
    assert set(SUPPORTED_SCHEDULERS) == {
        "WarmupLR",
        "WarmupDecayLR",
        "WarmupCosineLR",
        "OneCycle",
        "LRRangeTest",
    }


@pytest.mark.parametrize("case", SCHEDULE_CASES, ids=_case_id)
def test_schedule_matches_deepspeed(case: tuple[str, str, dict[str, Any]], ds_lr_schedules: Any) -> None:
    name, kind, params = case
    ours_opt, ds_opt = _two_group_optimizer(kind), _two_group_optimizer(kind)
    ours = build_scheduler(name, params, ours_opt)
    theirs = getattr(ds_lr_schedules, name)(ds_opt, **params)
    ours_trace, ds_trace = _trace(ours, ours_opt, STEPS), _trace(theirs, ds_opt, STEPS)
    _assert_same_sequence(ours_trace, ds_trace)
    assert ours.get_last_lr() == theirs.get_last_lr()
    assert ours.state_dict() == theirs.state_dict() == {"last_batch_iteration": STEPS - 1}
    # The schedule must actually move (a constant sequence would match trivially).
    assert len({row[0] for row in ours_trace}) > 1


@pytest.mark.parametrize("case", SCHEDULE_CASES[::3], ids=_case_id)
def test_schedule_explicit_iteration_matches_deepspeed(
    case: tuple[str, str, dict[str, Any]], ds_lr_schedules: Any
) -> None:
    name, kind, params = case
    ours_opt, ds_opt = _two_group_optimizer(kind), _two_group_optimizer(kind)
    ours = build_scheduler(name, params, ours_opt)
    theirs = getattr(ds_lr_schedules, name)(ds_opt, **params)
    for iteration in (5, 137, 3, 260, 1000):
        ours.step(iteration)
        theirs.step(iteration)
        assert [g["lr"] for g in ours_opt.param_groups] == [g["lr"] for g in ds_opt.param_groups]
        assert ours.state_dict() == {"last_batch_iteration": iteration}


@pytest.mark.parametrize("case", SCHEDULE_CASES, ids=_case_id)
def test_schedule_state_dict_resumes_sequence(case: tuple[str, str, dict[str, Any]]) -> None:
    name, kind, params = case
    full_opt = _two_group_optimizer(kind)
    full = _trace(build_scheduler(name, params, full_opt), full_opt, 220)

    first_opt = _two_group_optimizer(kind)
    first = build_scheduler(name, params, first_opt)
    _trace(first, first_opt, 120)
    saved = first.state_dict()
    assert saved == {"last_batch_iteration": 119}

    resumed_opt = _two_group_optimizer(kind)
    resumed = build_scheduler(name, params, resumed_opt)
    resumed.load_state_dict(saved)
    _assert_same_sequence(_trace(resumed, resumed_opt, 100)[1:], full[121:])


def test_state_dict_loads_into_deepspeed_scheduler(ds_lr_schedules: Any) -> None:
    params = {"total_num_steps": 300, "warmup_num_steps": 40}
    ours_opt, ds_opt = _two_group_optimizer("adam"), _two_group_optimizer("adam")
    ours = build_scheduler("WarmupDecayLR", params, ours_opt)
    for _ in range(77):
        ours.step()
    theirs = ds_lr_schedules.WarmupDecayLR(ds_opt, **params)
    theirs.load_state_dict(ours.state_dict())
    ours.step()
    theirs.step()
    assert ours.get_last_lr() == theirs.get_last_lr()


def test_construction_sets_initial_lr_and_beta2_quirk() -> None:
    opt = _two_group_optimizer("adam")
    build_scheduler("WarmupLR", {"warmup_min_lr": 1e-6}, opt)
    assert [g["lr"] for g in opt.param_groups] == [1e-6, 1e-6]

    opt = _two_group_optimizer("adam")
    build_scheduler("WarmupCosineLR", {"total_num_steps": 10}, opt)
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]

    opt = _two_group_optimizer("adam")
    sched = build_scheduler("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}, opt)
    # DeepSpeed's OneCycle starts at min lr / min momentum and pins beta2 to 0.99.
    assert [g["betas"] for g in opt.param_groups] == [(0.8, 0.99), (0.8, 0.99)]
    assert sched.get_last_lr() == [1e-4, 1e-4]

    opt = _two_group_optimizer("adam")
    build_scheduler("WarmupLR", {"warmup_min_lr": 1e-6, "last_batch_iteration": 10}, opt)
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 4e-3]  # resuming: untouched until step()


def test_tensor_lr_is_filled_in_place() -> None:
    p = _params(n=1)
    lr = torch.tensor(1e-3, dtype=torch.float64)
    opt = torch.optim.AdamW([{"params": p, "lr": lr}], foreach=False)
    sched = build_scheduler("WarmupLR", {"warmup_num_steps": 10, "warmup_type": "linear"}, opt)
    sched.step()
    sched.step()
    assert opt.param_groups[0]["lr"] is lr
    assert lr.item() == pytest.approx(1e-3 * 1 / 10)


def test_scheduler_works_through_wrapper() -> None:
    opt = _two_group_optimizer("sgd")
    wrapper = types.SimpleNamespace(optimizer=opt)
    sched = build_scheduler("LRRangeTest", {"lr_range_test_step_size": 4}, wrapper)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 1.25)


@pytest.mark.parametrize(
    ("sched_type", "params", "key", "fragment"),
    [
        ("CosineAnnealingLR", {}, "scheduler.type", "WarmupLR"),
        ("WarmupLR", {"warmup_steps": 10}, "scheduler.params.warmup_steps", "warmup_num_steps"),
        ("WarmupDecayLR", {}, "scheduler.params.total_num_steps", "requires"),
        (
            "WarmupCosineLR",
            {"total_num_steps": 9, "warmup_max_lr": 1e-3},
            "scheduler.params.warmup_max_lr",
            "warmup_min_ratio",
        ),
        ("WarmupLR", {"warmup_type": "cosine"}, "scheduler.params.warmup_type", "linear"),
        ("WarmupLR", {"warmup_num_steps": 0}, "scheduler.params.warmup_num_steps", ">= 1"),
        ("WarmupLR", {"warmup_num_steps": "auto"}, "scheduler.params.warmup_num_steps", "integer"),
        (
            "WarmupLR",
            {"warmup_max_lr": [1e-3]},
            "scheduler.params.warmup_max_lr",
            "one value per param group",
        ),
        ("OneCycle", {"cycle_min_lr": 1e-4}, "scheduler.params.cycle_max_lr", "requires"),
        (
            "OneCycle",
            {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 0},
            "scheduler.params.cycle_first_step_size",
            "positive",
        ),
        ("LRRangeTest", {"lr_range_test_step_size": 0}, "scheduler.params.lr_range_test_step_size", ">= 1"),
    ],
)
def test_scheduler_config_errors_name_the_key(sched_type: str, params: dict[str, Any], key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_scheduler(sched_type, params, _two_group_optimizer("adam"))
    assert info.value.key == key
    assert fragment in str(info.value)


def test_scheduler_type_is_case_insensitive() -> None:
    sched = build_scheduler("warmupdecaylr", {"total_num_steps": 5}, _two_group_optimizer("adam"))
    assert type(sched).__name__ == "WarmupDecayLR"


# --------------------------------------------------------------------------------------------------
# optimizers


def _step_both(
    ours: torch.optim.Optimizer,
    ours_params: list[torch.nn.Parameter],
    ref: torch.optim.Optimizer,
    ref_params: list[torch.nn.Parameter],
    steps: int = 3,
) -> None:
    for step in range(steps):
        _set_grads(ours_params, step)
        _set_grads(ref_params, step)
        ours.step()
        ref.step()


def _assert_params_close(a: list[torch.nn.Parameter], b: list[torch.nn.Parameter]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_adam_type_defaults_to_decoupled_weight_decay() -> None:
    cfg = {"lr": 1e-2, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1}
    ours_p, adamw_p, adam_p = _params(), _params(), _params()
    ours = build_optimizer("Adam", cfg, [{"params": ours_p}])
    assert isinstance(ours, torch.optim.AdamW)
    adamw = torch.optim.AdamW(adamw_p, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, foreach=False)
    adam = torch.optim.Adam(adam_p, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, foreach=False)
    _step_both(ours, ours_p, adamw, adamw_p)
    for step in range(3):
        _set_grads(adam_p, step)
        adam.step()
    _assert_params_close(ours_p, adamw_p)
    assert not torch.allclose(ours_p[0], adam_p[0], rtol=1e-6, atol=0)  # L2 Adam differs


def test_adam_w_mode_false_gives_l2_adam() -> None:
    ours_p, ref_p = _params(), _params()
    ours = build_optimizer("adam", {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": False}, [{"params": ours_p}])
    assert type(ours) is torch.optim.Adam
    ref = torch.optim.Adam(ref_p, lr=1e-2, weight_decay=0.1, foreach=False)
    _step_both(ours, ours_p, ref, ref_p)
    _assert_params_close(ours_p, ref_p)


def test_adamw_type_ignores_adam_w_mode_false() -> None:
    ours = build_optimizer("ADAMW", {"adam_w_mode": False}, [{"params": _params()}])
    assert type(ours) is torch.optim.AdamW


def test_adam_weight_decay_default_follows_deepspeed() -> None:
    fused_like = build_optimizer("AdamW", {}, [{"params": _params()}])
    assert fused_like.defaults["weight_decay"] == 0.0  # FusedAdam / DeepSpeedCPUAdam default
    torch_adam = build_optimizer("AdamW", {"torch_adam": True}, [{"params": _params()}])
    assert torch_adam.defaults["weight_decay"] == 0.01  # torch.optim.AdamW default, as DeepSpeed passes through
    torch_l2 = build_optimizer("Adam", {"torch_adam": True, "adam_w_mode": False}, [{"params": _params()}])
    assert type(torch_l2) is torch.optim.Adam and torch_l2.defaults["weight_decay"] == 0.0


def test_deepspeed_only_keys_are_consumed() -> None:
    cfg = {
        "adam_w_mode": True,
        "torch_adam": False,
        "bias_correction": True,
        "fp32_optimizer_states": True,
        "set_grad_none": True,
        "betas": [0.9, 0.95],
    }
    opt = build_optimizer("Adam", cfg, [{"params": _params()}])
    group = opt.param_groups[0]
    for key in ("adam_w_mode", "torch_adam", "bias_correction", "fp32_optimizer_states", "set_grad_none"):
        assert key not in group and key not in opt.defaults
    assert group["betas"] == (0.9, 0.95)


@pytest.mark.parametrize(
    ("opt_type", "params"),
    [
        ("Adam", {"lr": 2e-3, "betas": [0.8, 0.9], "eps": 1e-7, "weight_decay": 0.05, "torch_adam": True}),
        ("Adam", {"lr": 2e-3, "weight_decay": 0.05, "torch_adam": True, "adam_w_mode": False}),
        ("AdamW", {"torch_adam": True, "amsgrad": True}),
        ("adagrad", {"lr": 0.05, "lr_decay": 0.01}),
        ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
        ("RMSprop", {"lr": 0.01, "alpha": 0.9, "centered": True}),
    ],
)
def test_optimizer_class_and_hyperparameters_match_deepspeed_engine(opt_type: str, params: dict[str, Any]) -> None:
    """Run DeepSpeed's own ``_configure_basic_optimizer`` on paths that need no compiled op."""
    engine_mod = pytest.importorskip("deepspeed.runtime.engine")
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    name = opt_type.lower() if opt_type.lower() in ds_config.DEEPSPEED_OPTIMIZERS else opt_type
    fake = types.SimpleNamespace(
        optimizer_params=lambda: dict(params),
        optimizer_name=lambda: name,
        zero_use_cpu_optimizer=lambda: False,
        has_moe_layers=False,
    )
    fake.get_optimizer_configuration = functools.partial(engine_mod.DeepSpeedEngine.get_optimizer_configuration, fake)
    theirs = engine_mod.DeepSpeedEngine._configure_basic_optimizer(fake, [{"params": _params()}])
    ours = build_optimizer(opt_type, params, [{"params": _params()}])
    assert type(ours) is type(theirs)
    for key, value in theirs.defaults.items():
        if key not in ("fused", "foreach", "differentiable", "capturable"):
            assert ours.defaults[key] == value, key


def test_sgd_with_momentum_matches_torch() -> None:
    ours_p, ref_p = _params(), _params()
    ours = build_optimizer(
        "SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}, [{"params": ours_p}]
    )
    ref = torch.optim.SGD(ref_p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, foreach=False)
    _step_both(ours, ours_p, ref, ref_p, steps=4)
    _assert_params_close(ours_p, ref_p)
    assert ours.state[ours_p[0]]["momentum_buffer"] is not None


def test_fastest_implementation_is_chosen() -> None:
    assert implementation_flags(_params(), frozenset({"cpu"})) == {"fused": True}
    assert implementation_flags(_params(), frozenset()) == {}
    assert implementation_flags([torch.zeros(3, dtype=torch.int64)], frozenset({"cpu"})) == {}
    opt = build_optimizer("Adam", {}, [{"params": _params()}])
    assert opt.defaults["fused"] is True
    explicit = build_optimizer("Adam", {"foreach": True}, [{"params": _params()}])
    assert explicit.defaults["foreach"] is True and not explicit.defaults["fused"]


def test_param_group_overrides_and_empty_groups() -> None:
    a, b = _params()
    opt = build_optimizer(
        "AdamW",
        {"lr": 1e-3, "weight_decay": 0.1},
        [
            {"params": [a], "name": "decay"},
            {"params": []},
            {"params": [b], "weight_decay": 0.0, "lr": 5e-4, "betas": [0.5, 0.6]},
        ],
    )
    assert len(opt.param_groups) == 2  # the empty group is dropped, as DeepSpeed drops it
    first, second = opt.param_groups
    assert (first["lr"], first["weight_decay"], first["name"]) == (1e-3, 0.1, "decay")
    assert (second["lr"], second["weight_decay"], second["betas"]) == (5e-4, 0.0, (0.5, 0.6))


def test_tensor_lr_in_param_group_is_kept() -> None:
    lr = torch.tensor(2e-3)
    opt = build_optimizer("AdamW", {}, [{"params": _params(), "lr": lr}])
    assert opt.param_groups[0]["lr"] is lr
    with pytest.raises(ConfigError) as info:
        build_optimizer("AdamW", {}, [{"params": _params(), "lr": torch.tensor(-1.0)}])
    assert info.value.key == "param_groups[0].lr"


def test_lion_update_matches_deepspeed_formula() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0, 0.5], dtype=torch.float64))
    opt = build_optimizer("lion", {"lr": 0.1, "betas": [0.9, 0.99], "weight_decay": 0.5}, [{"params": [p]}])
    assert isinstance(opt, Lion)
    grad = torch.tensor([0.3, -0.2, 0.0, 1.0], dtype=torch.float64)
    p.grad = grad.clone()
    opt.step()
    # c = 0.1 * g; FusedLion moves by -lr where c > 0 and +lr elsewhere (including c == 0).
    start = torch.tensor([1.0, -2.0, 3.0, 0.5], dtype=torch.float64)
    expected = start * (1 - 0.1 * 0.5) + torch.tensor([-0.1, 0.1, 0.1, -0.1], dtype=torch.float64)
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-15)
    torch.testing.assert_close(opt.state[p]["exp_avg"], 0.01 * grad, rtol=0, atol=1e-15)


def test_supported_optimizers_all_build_and_step() -> None:
    for name in SUPPORTED_OPTIMIZERS:
        params = _params()
        opt = build_optimizer(name, {"lr": 1e-2}, [{"params": params}])
        before = params[0].detach().clone()
        _set_grads(params, 0)
        opt.step()
        assert not torch.equal(before, params[0].detach()), name


@pytest.mark.parametrize(
    ("opt_type", "params", "key", "fragment", "error"),
    [
        ("Adamm", {}, "optimizer.type", "AdamW", ConfigError),
        ("Lamb", {}, "optimizer.type", "not supported yet", NotYetSupportedError),
        ("Adam", {"foo": 1}, "optimizer.params.foo", "betas", ConfigError),
        ("SGD", {"betas": [0.9, 0.9]}, "optimizer.params.betas", "momentum", ConfigError),
        ("Adam", {"betas": [0.9]}, "optimizer.params.betas", "pair", ConfigError),
        ("Adam", {"betas": 0.9}, "optimizer.params.betas", "pair", ConfigError),
        ("Adam", {"betas": [0.9, 1.5]}, "optimizer.params.betas[1]", "< 1.0", ConfigError),
        ("Adam", {"lr": -1e-3}, "optimizer.params.lr", ">= 0.0", ConfigError),
        ("Adam", {"lr": "auto"}, "optimizer.params.lr", "number", ConfigError),
        ("Adam", {"adam_w_mode": "yes"}, "optimizer.params.adam_w_mode", "true or false", ConfigError),
        ("AdamW", {"max_grad_norm": 1.0}, "optimizer.params.max_grad_norm", "gradient_clipping", ConfigError),
        (
            "Adam",
            {"bias_correction": False},
            "optimizer.params.bias_correction",
            "torch",
            NotYetSupportedError,
        ),
        ("SGD", {"nesterov": True}, "optimizer.params.nesterov", "momentum", ConfigError),
    ],
)
def test_optimizer_config_errors_name_the_key(
    opt_type: str, params: dict[str, Any], key: str, fragment: str, error: type[Exception]
) -> None:
    with pytest.raises(error) as info:
        build_optimizer(opt_type, params, [{"params": _params()}])
    assert isinstance(info.value, ConfigError)
    assert info.value.key == key
    assert fragment in str(info.value)


def test_param_group_errors() -> None:
    with pytest.raises(ConfigError) as info:
        build_optimizer("Adam", {}, [{"params": _params(), "adam_w_mode": False}])
    assert info.value.key == "param_groups[0].adam_w_mode"
    with pytest.raises(ConfigError) as info:
        build_optimizer("Adam", {}, [{"params": _params()}, {"params": _params(1), "lr": -1.0}])
    assert info.value.key == "param_groups[1].lr"
    with pytest.raises(ConfigError, match="no parameters"):
        build_optimizer("Adam", {}, [{"params": []}])
