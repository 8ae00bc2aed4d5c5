"""The stage plan (core/plan.py): which copies exist and where, decided once; the built stage and the
estimator follow it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.core.offload import Residency
from zeroshard.core.plan import GradReduction, make_plan

D, H, F = Residency.DEVICE, Residency.HOST, Residency.FILE


@pytest.mark.parametrize(("stage", "fp32", "masters", "accelerator", "alias", "swapped"), [
    (0, True, D, False, True, False),    # fp32: the parameters are the masters
    (2, True, D, True, True, False),
    (2, False, D, True, False, False),   # 16-bit compute: a separate fp32 copy
    (2, True, H, True, False, False),    # CPU offload on a GPU: masters in host memory, apart
    (2, True, H, False, True, False),    # on the CPU, host memory is the device's
    (2, True, F, True, False, True),     # NVMe: in files
    (2, True, F, False, True, False),    # NVMe on the CPU with fp32: aliased, nothing to swap
    (3, True, D, False, False, False),   # stage 3 never aliases its masters to the parameters
    (3, False, F, True, False, True),
])
def test_masters(stage: int, fp32: bool, masters: Residency, accelerator: bool, alias: bool, swapped: bool) -> None:
    plan = make_plan(stage, 4, fp32, masters, D, accelerator)
    assert (plan.masters_alias_params, plan.masters_swapped) == (alias, swapped)
    assert plan.compute_copy == (swapped and stage < 3)


@pytest.mark.parametrize(("fp32", "masters", "params", "accelerator", "aliases", "lends"), [
    (True, D, D, False, True, True),     # CPU fp32: units gathered from the masters, rows lent
    (False, D, D, True, True, False),    # GPU bf16, both on the device: gathered and cast from the masters
    (True, H, H, True, True, False),     # both in host memory, fp32: from the masters
    (False, H, H, True, False, False),   # a bf16 shard in host memory is a copy
    (False, H, D, True, False, False),   # masters on the host, parameters on the device
    (True, D, F, False, False, False),   # parameters in a file
])
def test_stage3_parameter_shard(fp32: bool, masters: Residency, params: Residency, accelerator: bool,
                                aliases: bool, lends: bool) -> None:
    plan = make_plan(3, 2, fp32, masters, params, accelerator)
    assert plan.param_shard_aliases_masters is aliases
    assert plan.lends_rows is lends


def test_reduction_and_sharding_by_stage() -> None:
    plans = [make_plan(s, 2, True, D, D, False) for s in range(4)]
    assert [p.reduction for p in plans] == [GradReduction.ALL_REDUCE, GradReduction.REDUCE_SCATTER_AT_BOUNDARY,
                                            GradReduction.REDUCE_SCATTER_EVERY_MICRO_STEP,
                                            GradReduction.REDUCE_SCATTER_EVERY_MICRO_STEP]
    assert [p.sharded for p in plans] == [False, True, True, True]
    assert [p.layout_world for p in plans] == [1, 2, 2, 2]
    assert not make_plan(2, 1, True, D, D, False).sharded  # one rank: nothing to split
    with pytest.raises(ValueError, match="ZeRO stage must be"):
        make_plan(4, 2, True, D, D, False)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("bf16", [False, True])
def test_built_stage_follows_its_plan(process_group: None, stage: int, bf16: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    engine, optimizer, *_ = zeroshard.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    plan = optimizer.plan
    assert plan == make_plan(stage, 1, not bf16, D, D, accelerator=False)
    assert optimizer.master.aliased is plan.masters_alias_params
    assert (optimizer.coordinator is not None) is plan.shards_parameters
    assert optimizer.sync.reduces_every_micro_step is plan.shards_gradients
    if plan.shards_parameters:
        assert optimizer.shard.aliased is plan.param_shard_aliases_masters
        assert (optimizer.lender is not None) is plan.lends_rows
    engine.destroy()
