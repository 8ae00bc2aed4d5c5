"""Hybrid sharding (``zero_optimization.hybrid_shard_size``): shard inside groups, replicate across.

Real multi-process gloo runs through the public API:

* Parity: stages 1-3 on 4 ranks as 2 groups of 2 (``hybrid_shard_size: 2``) and on 2 ranks as 2
  groups of 1, 6 steps of accumulation 2 with clipping at 1.0 and AdamW, reach plain
  single-process PyTorch's parameters (fp32: G <= 1e-5).
* Memory: each rank holds its group's shard, not the world's: fp32 masters and Adam's moments of
  Ψ/2 elements (padding aside) on 4 ranks with groups of 2, twice the flat layout's Ψ/4.
* Collectives: gradients are reduce-scattered inside a group and all-reduced across the groups
  (the comms logger sees both; with ``LOCAL_WORLD_SIZE=2`` the groups are the nodes, and the
  replicate all-reduce is filed as crossing them).
* Checkpoints: saved by a hybrid run (stage 3, 4 ranks, groups of 2), loaded into the flat layout
  on 2 ranks at stage 2, and the other way round (flat stage 3 on 2 ranks into hybrid stage 1 on
  4), each then trained 3 more steps: the parameters equal those of the run that never stopped.
* Bad input: a size that does not divide the world, or at stage 0, is a ConfigError naming the key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import run_distributed
from models import make_data, make_model, micro_batch, train_reference

import zeroshard
from zeroshard.core.comm import collectives as C
from zeroshard.errors import ConfigError

GLOBAL_BATCH, GA, STEPS, LR, CLIP = 24, 2, 6, 1e-2, 1.0
KEY = "zero_optimization.hybrid_shard_size"


def _config(stage: int, hybrid: int, logger: bool = False) -> dict[str, Any]:
    return {
        "train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": GA, "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 600, "overlap_comm": True,
                              "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 500,
                              "stage3_prefetch_bucket_size": 1200, "hybrid_shard_size": hybrid},
        "comms_logger": {"enabled": logger, "prof_all": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                   "weight_decay": 0.01}},
    }


def _train(engine: Any, rank: int, world: int, steps: range) -> None:
    x, y = make_data(STEPS, GLOBAL_BATCH)
    micro = GLOBAL_BATCH // (GA * world)
    for step in steps:
        for m in range(GA):
            engine.backward(engine(*(micro_batch(t, step, m, rank, world, micro) for t in (x, y))))
            engine.step()


def _params(engine: Any) -> dict[str, torch.Tensor]:
    with engine.gathered():
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def parity(rank: int, world: int, hybrid: int) -> dict[str, Any]:
    os.environ["LOCAL_WORLD_SIZE"] = str(max(hybrid, 1))
    out: dict[str, Any] = {}
    for stage in (1, 2, 3):
        model = make_model(0)
        engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                          config=_config(stage, hybrid, logger=True))
        _train(engine, rank, world, range(STEPS))
        records = dict(C.HOOK.recorder.records)  # type: ignore[union-attr]
        engine.comms_logger.uninstall()
        out[f"s{stage}"] = {"params": _params(engine), "usage": engine.memory_usage(),
                            "ops": sorted(records), "master_numel": int(engine.optimizer.master.numel)}
        engine.destroy()
    return out


def _distance(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    diff = torch.cat([(params[n] - ref[n]).flatten() for n in ref])
    return float(diff.norm() / torch.cat([r.flatten() for r in ref.values()]).norm())


def _reference() -> dict[str, torch.Tensor]:
    x, y = make_data(STEPS, GLOBAL_BATCH)
    return {n: p.detach().clone() for n, p in train_reference(make_model(0), x, y, LR, CLIP).named_parameters()}


@pytest.mark.parametrize(("world", "hybrid"), [(4, 2), (2, 1)], ids=["2groups_x2", "2groups_x1"])
def test_hybrid_sharding_trains_as_plain_pytorch(world: int, hybrid: int) -> None:
    results = run_distributed(parity, world, hybrid, timeout=600)
    ref = _reference()
    psi = sum(t.numel() for t in ref.values())
    for stage in (1, 2, 3):
        for rank, r in enumerate(results):
            g = _distance(r[f"s{stage}"]["params"], ref)
            assert g <= 1e-5, (stage, rank, g)
        r0 = results[0][f"s{stage}"]
        print(f"world {world}, groups of {hybrid}, stage {stage}: G = {_distance(r0['params'], ref):.1e}, "
              f"master shard {r0['master_numel']} of {psi}, collectives {r0['ops']}")
        # the group's shard: Ψ/hybrid elements (per-parameter padding to the group's size aside)
        assert psi / hybrid <= r0["master_numel"] <= psi / hybrid + 8 * hybrid * 2, (stage, r0["master_numel"], psi)
        # reduced inside the group, all-reduced across the groups (filed as crossing the nodes)
        if hybrid > 1:
            assert any(op.startswith("reduce_scatter_tensor") for op in r0["ops"]), r0["ops"]
        assert "all_reduce | across nodes" in r0["ops"], r0["ops"]


def save_then_resume(rank: int, world: int, stage: int, hybrid: int, path: str, phase: str) -> dict[str, Any]:
    model = make_model(0)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=_config(stage, hybrid))
    half = STEPS // 2
    if phase == "save":
        _train(engine, rank, world, range(half))
        engine.save_checkpoint(path, tag="half")
        _train(engine, rank, world, range(half, STEPS))
    else:
        engine.load_checkpoint(path, tag="half")
        assert engine.global_steps == half
        _train(engine, rank, world, range(half, STEPS))
    out = _params(engine)
    engine.destroy()
    return out


@pytest.mark.parametrize(("saved", "loaded"), [((4, 3, 2), (2, 2, 0)), ((2, 3, 0), (4, 1, 2))],
                         ids=["hybrid_into_flat", "flat_into_hybrid"])
def test_checkpoints_cross_between_hybrid_and_flat(tmp_path: Path, saved: tuple[int, int, int],
                                                    loaded: tuple[int, int, int]) -> None:
    (w_save, s_save, h_save), (w_load, s_load, h_load) = saved, loaded
    path = str(tmp_path / "ckpt")
    unbroken = run_distributed(save_then_resume, w_save, s_save, h_save, path, "save", timeout=600)[0]
    resumed = run_distributed(save_then_resume, w_load, s_load, h_load, path, "load", timeout=600)
    for rank, params in enumerate(resumed):
        g = _distance(params, unbroken)
        assert g <= 1e-5, (rank, g)


def bad(rank: int, world: int, stage: int, hybrid: int) -> str:
    model = make_model(0)
    try:
        zeroshard.initialize(model=model, model_parameters=model.parameters(), config=_config(stage, hybrid))
    except ConfigError as e:
        return f"{e.key}: {e}"
    return "no error"


@pytest.mark.parametrize(("stage", "hybrid", "words"), [(2, 3, "hybrid_shard_size 3 does not divide the world size 4"),
                                                        (0, 2, "needs ZeRO stage 1, 2 or 3")])
def test_bad_hybrid_shard_size(stage: int, hybrid: int, words: str) -> None:
    for message in run_distributed(bad, 4, stage, hybrid):
        assert message.startswith(f"{KEY}: ") and words in message, message
