"""Partial optimizer offload (``zero_optimization.offload_optimizer.ratio``): which sub-groups go where,
the plan, the estimator, and the refusals. One process; the training runs are in
``tests/distributed/test_partial_offload.py``.

DeepSpeed 0.19.8 (``runtime/zero/stage3.py``, ``_create_fp32_partitions``) offloads sub-group ``i``
when ``i >= int((1 - ratio) * n)`` of ``n``: ``ratio`` is the fraction *offloaded*, the kept ones are
the *first*, and the count is truncated after a float multiplication, which the expected values
below pin (rounding it, or counting the offloaded ones first, fails them).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from harness import log_lines
from torch import nn

import zeroshard
from zeroshard.config import load_config, support
from zeroshard.config.support import NotYetSupported
from zeroshard.core.offload import OffloadPolicy, Residency
from zeroshard.core.offload.policy import device_subgroups
from zeroshard.core.offload.state_store import SplitStateStore, StateStore
from zeroshard.core.plan import make_plan
from zeroshard.errors import ConfigError, NotYetSupportedError
from zeroshard.estimate.model_spec import spec_from_count, spec_from_module
from zeroshard.estimate.residency import Offload, placement, subgroup_sizes, unit_rows

KEY = "zero_optimization.offload_optimizer.ratio"
D, H = Residency.DEVICE, Residency.HOST


@pytest.mark.parametrize(("ratio", "count", "kept"), [
    (0.5, 6, 3), (0.5, 5, 2), (0.5, 3, 1), (0.5, 1, 0),
    (0.3, 10, 7),   # (1 - 0.3) * 10 = 7.000000000000001
    (0.7, 10, 3),   # 3.0000000000000004
    (0.9, 10, 0),   # 0.9999999999999998: none kept, where rounding would keep 1
    (0.1, 10, 9),
    (0.75, 4, 1), (0.25, 4, 3), (0.2, 5, 4), (0.6, 5, 2),
    (0.0, 4, 4), (1.0, 4, 0), (0.5, 0, 0),
])
def test_device_subgroups_is_deepspeeds_count(ratio: float, count: int, kept: int) -> None:
    assert device_subgroups(ratio, count) == kept
    # DeepSpeed's own expression, sub-group by sub-group
    assert [i >= int((1 - ratio) * count) for i in range(count)] == [i >= kept for i in range(count)]


def test_the_first_subgroups_stay_on_the_device() -> None:
    policy = OffloadPolicy(optimizer=H, ratio=0.3)
    assert policy.partial
    assert policy.subgroup_residencies(10) == (D,) * 7 + (H,) * 3
    assert OffloadPolicy(optimizer=H, ratio=0.9).subgroup_residencies(10) == (H,) * 10
    assert OffloadPolicy(optimizer=H, ratio=0.0).subgroup_residencies(3) == (D,) * 3
    # ratio 1.0 is plain CPU offload; without offload the ratio changes nothing (as DeepSpeed)
    assert not OffloadPolicy(optimizer=H, ratio=1.0).partial
    assert OffloadPolicy(optimizer=D, ratio=0.5).subgroup_residencies(4) == (D,) * 4
    assert not OffloadPolicy(optimizer=D, ratio=0.5).partial


def _cfg(**zero: Any) -> dict[str, Any]:
    return {"train_batch_size": 2, "zero_optimization": zero}


def test_ratio_loads_at_stage3_and_reaches_the_policy() -> None:
    cfg = load_config(_cfg(stage=3, offload_optimizer={"device": "cpu", "ratio": 0.5}), 1)
    policy = OffloadPolicy.from_config(cfg)
    assert policy.ratio == 0.5 and policy.partial
    assert OffloadPolicy.from_config(load_config(_cfg(stage=3, offload_optimizer={"device": "cpu"}), 1)).ratio == 1.0


@pytest.mark.parametrize(("zero", "match"), [
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, "requires ZeRO stage 3, not stage 2"),
    ({"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 0.0}}, "requires ZeRO stage 3, not stage 1"),
    # DeepSpeed's validator refuses it below stage 3 whatever the device
    ({"stage": 2, "offload_optimizer": {"device": "none", "ratio": 0.5}}, "requires ZeRO stage 3"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}, "less than or equal to 1"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": -0.1}}, "greater than or equal to 0"),
])
def test_refusals_name_the_key(zero: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as e:
        load_config(_cfg(**zero), 1)
    assert e.value.key == KEY
    assert not isinstance(e.value, NotYetSupportedError)


def test_not_yet_supported_rows_still_refuse(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table is empty now that ratio is supported; a row still raises naming its key."""
    row = NotYetSupported("zero_optimization.sub_group_size", lambda v: v == 12345, "a feature", "an issue")
    monkeypatch.setattr(support, "NOT_YET_SUPPORTED", [row])
    with pytest.raises(NotYetSupportedError) as e:
        load_config(_cfg(stage=3, sub_group_size=12345), 1)
    assert e.value.key == "zero_optimization.sub_group_size"
    assert load_config(_cfg(stage=3, sub_group_size=12345), 1, check_support=False) is not None


def test_plan_of_split_masters() -> None:
    for accelerator in (True, False):
        plan = make_plan(3, 2, True, H, D, accelerator, split_masters=True)
        assert plan.masters_split and plan.masters is H
        # two master buffers: the parameter shard is a copy of its own, no row is lent
        assert not plan.param_shard_aliases_masters and not plan.lends_rows
    assert make_plan(3, 2, True, H, D, False).param_shard_aliases_masters  # unsplit on the CPU: aliased
    for stage, masters in ((2, H), (3, D), (3, Residency.FILE)):
        with pytest.raises(ValueError, match="partial optimizer offload"):
            make_plan(stage, 2, True, masters, D, True, split_masters=True)


class Layers(nn.Module):
    """Five ZeRO-3 units of different sizes, in module order."""

    def __init__(self, n: int = 5) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(7 + i, 9 + i) for i in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(torch.nn.functional.pad(x, (0, layer.in_features - x.shape[-1])))
        return x


def _engine(ratio: float, n: int = 5, sub_group_size: int = 1) -> Any:
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "zero_optimization": {"stage": 3, "sub_group_size": sub_group_size,
                                 "stage3_param_persistence_threshold": 0,
                                 "offload_optimizer": {"device": "cpu", "ratio": ratio}},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}
    return zeroshard.initialize(model=Layers(n), config=cfg)[0]


def test_engine_keeps_the_first_units_on_the_device(process_group: None) -> None:
    engine = _engine(0.5)  # sub_group_size 1: each unit (a layer) is a sub-group; int(0.5 * 5) = 2 kept
    opt = engine.optimizer
    store = opt.store
    assert isinstance(store, SplitStateStore)
    assert store.residencies == (D, D, H, H, H)
    layers = list(engine.module.layers)
    kept = {id(p) for layer in layers[:2] for p in layer.parameters()}
    device_part = opt.master.segments[0]
    for p, view in opt.master.views.items():
        on_device_part = view.untyped_storage().data_ptr() == device_part.untyped_storage().data_ptr()
        assert on_device_part == (id(p) in kept), "the kept sub-groups are the first units in module order"
    assert opt.master.kept.end == store.subgroups[2].start == device_part.numel()
    assert not opt.shard.aliased and opt.lender is None
    # one step: every sub-group steps where its state is, and publishes into the parameter shard
    x = torch.randn(2, 7)
    engine.backward(engine(x).square().mean())
    engine.step()
    placed = opt.memory_placement()
    kept_numel = sum(sg.numel for sg in store.subgroups[:2])
    assert placed["master_weights"] == {"device": 4 * kept_numel, "host": 4 * (opt.master.numel - kept_numel)}
    assert set(placed["optimizer_states"]) == {"device", "host"}
    with pytest.raises(RuntimeError, match="no single flat buffer"):
        _ = opt.master.flat
    engine.destroy()


def test_engine_ratio_one_and_none_kept(process_group: None) -> None:
    engine = _engine(1.0)
    assert type(engine.optimizer.store) is StateStore  # plain CPU offload
    engine.destroy()
    lines = log_lines(logging.WARNING)
    engine = _engine(0.9, n=10)  # int((1 - 0.9) * 10) = 0: everything offloaded, and a warning says so
    assert engine.optimizer.store.residencies == (H,) * 10
    assert engine.optimizer.master.kept.end == 0
    assert any("keeps none of this rank's 10 optimizer sub-group(s)" in line for line in lines), lines
    engine.destroy()


def test_ratio_without_offload_warns(process_group: None) -> None:
    lines = log_lines(logging.WARNING)
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none", "ratio": 0.5}},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}
    engine = zeroshard.initialize(model=Layers(2), config=cfg)[0]
    assert type(engine.optimizer.store) is StateStore
    assert any(KEY in line and "has no effect" in line for line in lines), lines
    engine.destroy()


@pytest.mark.parametrize("accelerator", [True, False])
def test_estimator_splits_by_subgroup(accelerator: bool) -> None:
    spec = spec_from_count(10_000_000, 1_000_000)
    world, sub_group = 4, 500_000
    rows = unit_rows(spec, world)
    sizes = subgroup_sizes(rows, sub_group)
    kept = sum(sizes[: device_subgroups(0.5, len(sizes))])
    total = sum(sizes)
    assert 0 < kept < total
    half = placement(spec, 3, world, "bf16", offload=Offload("cpu", sub_group_size=sub_group, ratio=0.5),
                     accelerator=accelerator)
    full = placement(spec, 3, world, "bf16", offload=Offload("cpu", sub_group_size=sub_group),
                     accelerator=accelerator)
    host = "pinned_host" if accelerator else "host"
    assert half.kinds["master_weights"] == {"device": 4 * kept, host: 4 * (total - kept)}
    assert half.kinds["optimizer_states"] == {"device": 8 * kept, "host": 8 * (total - kept)}
    assert full.kinds["optimizer_states"] == {"host": 8 * total}
    # the rest is the CPU offload's (gradients, parameter shard)
    for kind in ("gradients", "parameter_shard", "parameters"):
        if accelerator or kind != "parameter_shard":
            assert half.kinds.get(kind) == full.kinds.get(kind), kind
    assert Offload("cpu", ratio=0.5).label == "optimizer->cpu (ratio 0.5)"
    with pytest.raises(ValueError, match="ratio"):
        placement(spec, 2, world, offload=Offload("cpu", ratio=0.5))
    with pytest.raises(ValueError, match="ratio"):
        Offload("nvme", ratio=0.5)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_estimate_matches_the_engine(process_group: None, dtype: str) -> None:
    """The estimator's placement of ratio 0.5 is what a one-rank engine reports after a step."""
    with torch.device("meta"):
        spec = spec_from_module(Layers(), "layers")
    want = placement(spec, 3, 1, dtype, "fp32", Offload("cpu", sub_group_size=1, ratio=0.5), accelerator=False,
                     persistence_threshold=0)
    engine = _engine(0.5) if dtype == "fp32" else None
    if engine is None:
        torch.manual_seed(0)
        engine = zeroshard.initialize(model=Layers(), config={
            "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "sub_group_size": 1, "stage3_param_persistence_threshold": 0,
                                  "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})[0]
    try:
        engine.backward(engine(torch.randn(2, 7)).float().square().mean())
        engine.step()
        got = engine.optimizer.memory_placement()
        store = engine.optimizer.store
        # Adam's step counters (a 0-d fp32 tensor per master) are left out of the estimate
        for sg, res in zip(store.subgroups, store.residencies):
            got["optimizer_states"]["device" if res is D else "host"] -= 4 * len(sg.slices)
        want.kinds.pop("parameters", None)
        assert got == want.kinds
    finally:
        engine.destroy()


def test_estimate_cli_row(capsys: pytest.CaptureFixture[str]) -> None:
    from zeroshard.cli.estimate import main

    assert main(["--params", "7e9", "--gpus", "8", "--offload-ratio", "0.5", "--sub-group-size", "1e8"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 3 ")]
    assert [r.split("|")[2].strip() for r in rows][1:3] == ["optimizer->cpu", "optimizer->cpu (ratio 0.5)"]
    for argv, message in ((["--params", "7e9", "--offload-ratio", "1"], "--offload-ratio: must be in [0, 1)"),
                          (["--params", "7e9", "--sub-group-size", "1e8"], "only used with --offload-ratio")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
