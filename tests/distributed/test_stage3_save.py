"""ZeRO-3 checkpoints of a model whose units are really partitioned (issue 15), and failing fast
instead of hanging when a collective would run on a subset of the ranks.

The model is ``examples/gpt.py``'s GPT at width 192 (1.9M parameters): its attention ``qkv`` and
MLP layers are above the default ``stage3_param_persistence_threshold`` (100k elements), so they
are partitioned units and, after a step, sharded at rest. ``save_checkpoint`` used to gather them
from a block that runs on rank 0 only (the module layout is read through ``state_dict()``), which
hung rank 0 in an all-gather that the other ranks never joined.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import log_lines, run_distributed
from models import gathered_weights, relative_distance

import zeroshard
from zeroshard.core.comm import collectives as C
from zeroshard.core.comm import subset
from zeroshard.errors import DistributedError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402  (examples/gpt.py)

K, J = 3, 2  # steps before the save, steps after it
BATCH, T = 8, 32
REL_TOL = 1e-5
SMALL_LIVE = 1000  # stage3_max_live_parameters: no unit stays gathered


def make_gpt(seed: int, width: int = 192) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=256, block_size=T, n_layer=4, n_head=4, n_embd=width))


def config(stage: int, **zero) -> dict:
    return {"train_batch_size": BATCH, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage, **zero},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (K + J, BATCH, T + 1), generator=torch.Generator().manual_seed(7))


def train(engine, steps: range, rank: int, world: int) -> None:
    data, mb = tokens(), BATCH // world
    for step in steps:
        batch = data[step, rank * mb : (rank + 1) * mb]
        engine.backward(engine(batch[:, :-1].contiguous(), batch[:, 1:].contiguous()))
        engine.step()


def sharded_units(engine) -> int:
    return sum(u.state.value == "sharded" for u in engine.optimizer.units)


# -- the repro: save after training, both live budgets; resume 2 -> 2 ranks at stage 3 -------------
def save_worker(rank: int, world: int, root: str) -> dict:
    out: dict = {}
    for name, zero in (("default", {}), ("small_live", {"stage3_max_live_parameters": SMALL_LIVE})):
        engine, *_ = zeroshard.initialize(model=make_gpt(0), config=config(3, **zero))
        train(engine, range(K), rank, world)
        out[f"{name}/sharded_at_save"] = sharded_units(engine)
        start = time.perf_counter()
        engine.save_checkpoint(f"{root}/{name}")
        out[f"{name}/save_s"] = time.perf_counter() - start
        out[f"{name}/at_save"] = gathered_weights(engine)
        train(engine, range(K, K + J), rank, world)
        out[f"{name}/reference"] = gathered_weights(engine)
        fresh, *_ = zeroshard.initialize(model=make_gpt(1), config=config(3, **zero))
        fresh.load_checkpoint(f"{root}/{name}")
        assert fresh.global_steps == K
        train(fresh, range(K, K + J), rank, world)
        out[f"{name}/resumed"] = gathered_weights(fresh)
    return out


def resume_one_worker(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    engine, *_ = zeroshard.initialize(model=make_gpt(2), config=config(2))
    engine.load_checkpoint(f"{root}/small_live")
    train(engine, range(K, K + J), rank, world)
    return gathered_weights(engine)


def test_stage3_save_resume_and_convert(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from zeroshard.cli.main import main as cli

    root = str(tmp_path)
    r0, r1 = run_distributed(save_worker, 2, root, timeout=150)
    ref = r0["default/reference"]
    for name in ("default", "small_live"):
        assert r0[f"{name}/sharded_at_save"] > 0  # the save really had partitioned units to handle
        for key in ("at_save", "reference", "resumed"):
            assert all(torch.equal(r0[f"{name}/{key}"][n], r1[f"{name}/{key}"][n]) for n in ref), (name, key)
        assert all(torch.equal(r0[f"{name}/resumed"][n], r0[f"{name}/reference"][n]) for n in ref), name
        assert relative_distance(r0[f"{name}/reference"], ref) <= REL_TOL, name
    (one,) = run_distributed(resume_one_worker, 1, root, timeout=60)
    assert relative_distance(one, ref) <= REL_TOL
    out = tmp_path / "converted.safetensors"
    assert cli(["convert", f"{root}/small_live", str(out), "-q"]) == 0
    converted = load_file(out)
    assert converted.keys() == r0["small_live/at_save"].keys()
    assert all(torch.equal(converted[n], t) for n, t in r0["small_live/at_save"].items())


# -- 4 ranks: save, load, and the 16-bit export of a model no unit of which stays gathered ---------
def four_worker(rank: int, world: int, root: str) -> dict:
    zero = {"stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": SMALL_LIVE}
    cfg = {**config(3, **zero), "bf16": {"enabled": True}}
    engine, *_ = zeroshard.initialize(model=make_gpt(0, width=64), config=cfg)
    train(engine, range(2), rank, world)
    assert sharded_units(engine) == len(engine.optimizer.units)
    engine.save_checkpoint(f"{root}/ckpt")
    fresh, *_ = zeroshard.initialize(model=make_gpt(1, width=64), config=cfg)
    fresh.load_checkpoint(f"{root}/ckpt")
    assert fresh.save_16bit_model(f"{root}/export")
    out = {"saved": gathered_weights(engine), "loaded": gathered_weights(fresh)}
    # Rank 0 cannot write (the directory is a file): every rank raises, none is left in a gather.
    if rank == 0:
        Path(f"{root}/not-a-dir").write_text("")
    dist.barrier()
    with pytest.raises((OSError, zeroshard.CheckpointError)) as info:
        fresh.save_16bit_model(f"{root}/not-a-dir")
    out["failure"] = f"{type(info.value).__name__}: {info.value}"
    return out


def test_four_ranks_save_load_and_16bit_export(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    results = run_distributed(four_worker, 4, str(tmp_path), timeout=150)
    r0 = results[0]
    saved = load_file(tmp_path / "export" / "model.safetensors")
    assert saved.keys() == r0["loaded"].keys()
    for n, t in r0["loaded"].items():
        assert saved[n].dtype == torch.bfloat16 and torch.equal(saved[n].float(), t), n
        assert torch.equal(t, r0["saved"][n]), n
    assert not r0["failure"].startswith("CheckpointError")  # rank 0 raises its own error ...
    assert all("failed on rank 0" in r["failure"] for r in results[1:])  # ... and the others say so


# -- fail fast: a gather on a subset of ranks is an error naming the absent ranks -------------------
def subset_worker(rank: int, world: int) -> dict:
    os.environ["ZEROSHARD_ARRIVAL_TIMEOUT"] = "5"
    cfg = config(3, stage3_param_persistence_threshold=0)
    engine, *_ = zeroshard.initialize(model=make_gpt(0, width=64), config=cfg)
    train(engine, range(1), rank, world)
    assert sharded_units(engine) == len(engine.optimizer.units)
    out: dict = {}
    if rank == 0:  # what user code must not do: rank 1 goes straight to the barrier below
        start = time.perf_counter()
        with pytest.raises(DistributedError) as info:
            engine.module.state_dict()
        out["arrival"], out["arrival_s"] = str(info.value), time.perf_counter() - start
        start = time.perf_counter()
        out["blocked"] = []
        with C.on_ranks([0], "testing a block, which runs on rank 0 only"):
            for call in (lambda: C.all_reduce(torch.zeros(1), None), engine.module.state_dict,
                         engine.optimizer.units[0].launch_gather):
                with pytest.raises(DistributedError) as info:
                    call()
                out["blocked"].append(str(info.value))
        out["blocked_s"] = time.perf_counter() - start
    dist.barrier()
    # After an evaluation forward every unit is gathered: no all-gather is needed, but the explicit
    # gather would release the units on rank 0 alone, and the next forward would hang there.
    engine.eval()
    with torch.no_grad():
        engine(tokens()[0, :2, :T])
    engine.train()
    assert sharded_units(engine) == 0
    if rank == 0:
        subset.WARN_AFTER_S = 1.0  # a warning naming rank 1 first, then the error
        warnings = log_lines()
        with pytest.raises(DistributedError) as info:
            engine.module.state_dict()
        out["release"], out["warnings"] = str(info.value), warnings
    dist.barrier()
    # Inside a gather every rank made, rank 0 alone may take a state dict (DeepSpeed-Chat's rank-0
    # save): every unit stays gathered and pinned, so there is nothing to agree on.
    for gathered in (lambda: zeroshard.zero.GatheredParameters(list(engine.module.parameters())), engine.gathered):
        with gathered():
            if rank == 0:
                out.setdefault("inside", []).append({n: t.clone() for n, t in engine.module.state_dict().items()})
        dist.barrier()
    # Nothing was left half-done: a gather on every rank works, with full values.
    state = engine.module.state_dict()
    out["after"] = all(torch.equal(state[n], t) for n, t in gathered_weights(engine).items())
    out["inside_equal"] = [all(torch.equal(state[n], t) for n, t in sd.items()) for sd in out.get("inside", [])]
    return out


def test_gather_on_a_subset_of_ranks_fails_fast() -> None:
    r0, r1 = run_distributed(subset_worker, 2, timeout=90)
    unit = "all-gather of ZeRO-3 unit 'wte.weight'"
    assert r0["arrival"].startswith(f"{unit} (an explicit gather) at step 1: rank 1 did not start it within 5 s")
    assert 4.5 <= r0["arrival_s"] <= 20, r0["arrival_s"]
    block = "started while testing a block, which runs on rank 0 only: rank 1 would never join it"
    assert r0["blocked"][0].startswith(f"all-reduce {block}")
    assert r0["blocked"][1].startswith(f"{unit} (an explicit gather) {block}")
    assert r0["blocked"][2].startswith(f"{unit} {block}")
    assert r0["blocked_s"] < 1.0
    assert r0["release"].startswith("explicit gather of ZeRO-3 unit 'wte.weight', which releases it afterwards, "
                                    "at step 1: rank 1 did not start it within 5 s")
    assert any("is waiting for rank(s) [1]" in w for w in r0["warnings"]), r0["warnings"]
    assert r0["after"] and r1["after"]
    assert r0["inside_equal"] == [True, True]


def test_arrival_timeout_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(subset.ARRIVAL_TIMEOUT_ENV, raising=False)
    assert subset.arrival_timeout() == subset.DEFAULT_ARRIVAL_TIMEOUT_S
    monkeypatch.setenv(subset.ARRIVAL_TIMEOUT_ENV, "7.5")
    assert subset.arrival_timeout() == 7.5
    zeroshard.comm.set_arrival_timeout(3)
    try:
        assert subset.arrival_timeout() == 3  # the setter wins over the environment
    finally:
        zeroshard.comm.set_arrival_timeout(None)
    assert subset.arrival_timeout() == 7.5
    monkeypatch.setenv(subset.ARRIVAL_TIMEOUT_ENV, "soon")
    with pytest.raises(DistributedError, match="ZEROSHARD_ARRIVAL_TIMEOUT='soon' is not a number"):
        subset.arrival_timeout()
    with pytest.raises(ValueError):
        zeroshard.comm.set_arrival_timeout(0)


# -- DeepSpeed's parameter attributes, as scripts read them ------------------------------------------
def dschat_save_worker(rank: int, world: int) -> dict:
    """DeepSpeed-Chat's ``save_zero_three_model``: gather what ``hasattr(p, "ds_id")`` and
    ``p.ds_status == ZeroParamStatus.NOT_AVAILABLE`` say is partitioned, one parameter at a time."""
    from zeroshard.zero.param_status import ZeroParamStatus as Status

    cfg = config(3, stage3_param_persistence_threshold=0, stage3_max_live_parameters=0)
    engine, *_ = zeroshard.initialize(model=make_gpt(0, width=64), config=cfg)  # built whole, then partitioned
    train(engine, range(1), rank, world)
    params = list(engine.module.named_parameters())
    out: dict = {"tagged": all(hasattr(p, "ds_id") for _, p in params),
                 "ids_unique": len({p.ds_id for _, p in params}) == len(params),
                 "status_at_rest": sorted({p.ds_status.name for _, p in params}),
                 # Lightning's ZeRO-3 model summary counts parameters per device with partition_numel()
                 "partition_numel": {n: (p.partition_numel(), p.ds_numel) for n, p in params}}
    saved = {}
    for name, p in params:
        fetch = [q for q in [p] if hasattr(q, "ds_id") and q.ds_status == Status.NOT_AVAILABLE]
        with zeroshard.zero.GatheredParameters(fetch, enabled=bool(fetch)):
            out.setdefault("status_inside", []).append(p.ds_status.name)
            if rank == 0:
                saved[name] = p.data.clone()
    out["saved"] = saved
    out["want"] = gathered_weights(engine)
    return out


def test_partitioned_parameters_carry_deepspeed_attributes() -> None:
    for rank, r in enumerate(run_distributed(dschat_save_worker, 2)):
        assert r["tagged"] and r["ids_unique"], rank
        assert r["status_at_rest"] == ["NOT_AVAILABLE"], r["status_at_rest"]
        assert set(r["status_inside"]) == {"AVAILABLE"}, r["status_inside"]
        # DeepSpeed's padded chunk: ceil(numel / world) elements on every rank
        assert all(part == -(-numel // 2) for part, numel in r["partition_numel"].values()), r["partition_numel"]
        if rank == 0:
            assert r["saved"].keys() == r["want"].keys()
            assert all(torch.equal(r["saved"][n], t) for n, t in r["want"].items())
