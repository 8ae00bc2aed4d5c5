"""ZeRO++ quantized communication through the public API, in real multi-process gloo runs.

* **qwZ** (``zero_quantized_weights``, stage 3): parameter all-gathers carry int8 blocks and fp32
  scales; the fp32 masters stay exact.
* **qgZ** (``zero_quantized_gradients``, stages 2-3): gradients reduced by 4-bit all-to-alls,
  inside each node and then across nodes, summed in fp32.

Worlds: 2 nodes x 1 rank and 2 nodes x 2 ranks (``LOCAL_WORLD_SIZE`` 1 or 2, as torchrun sets it
on each of two machines: the topology module then builds the two levels' groups). qgZ quantizes
to 8 bits inside a node and to DeepSpeed's 4 bits across nodes.

Parity: after 20 steps (accumulation 2, clipping 1.0, AdamW), the parameters are within the
issue's G = ||w - w_ref|| / ||w_ref|| <= 5e-2 of plain single-process PyTorch, and not equal to
them (above 1e-6: the quantization really ran; the unquantized stages are within 1e-5).

Bytes, from the communication logger, per rank over the run, against the same run unquantized:
qwZ's parameter all-gathers <= 0.55x (bf16 training: int8 and scales against bf16); qgZ's
gradient bytes in collectives that cross nodes <= 0.3x (the plain reduce-scatter spans both
nodes: all its bytes; qgZ: only its across-nodes all-to-all, on partial sums already reduced
inside the node, at 4 bits), and no all-gather or reduce-scatter left at the world level.
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
from zeroshard.deepspeed.utils import safe_get_full_fp32_param
from zeroshard.estimate.model_spec import spec_from_module
from zeroshard.estimate.states import model_states

GLOBAL_BATCH, GA, STEPS, LR, CLIP = 24, 2, 20, 1e-2, 1.0
G_MAX = 5e-2


def _config(stage: int, qwz: bool, qgz: bool, bf16: bool, hpz: int = 1) -> dict[str, Any]:
    return {
        "train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": GA, "gradient_clipping": CLIP,
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 600, "overlap_comm": True,
                              "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 500,
                              "stage3_prefetch_bucket_size": 1200,
                              "zero_quantized_weights": qwz, "zero_quantized_gradients": qgz,
                              "zero_hpz_partition_size": hpz},
        "comms_logger": {"enabled": True, "prof_all": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                   "weight_decay": 0.01}},
    }


def train(rank: int, world: int, local: int, runs: list[tuple[int, bool, bool, bool, int]]) -> dict[str, Any]:
    os.environ["LOCAL_WORLD_SIZE"] = str(local)
    x, y = make_data(STEPS, GLOBAL_BATCH)
    micro = GLOBAL_BATCH // (GA * world)
    out: dict[str, Any] = {}
    for stage, qwz, qgz, bf16, hpz in runs:
        model = make_model(0)
        engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                          config=_config(stage, qwz, qgz, bf16, hpz))
        logger = C.HOOK.recorder
        for step in range(STEPS):
            for m in range(GA):
                engine.backward(engine(*(micro_batch(t, step, m, rank, world, micro) for t in (x, y))))
                engine.step()
        by_op: dict[str, int] = {}
        for name, sizes in logger.records.items():  # type: ignore[union-attr]
            by_op[name] = sum(size * rec.count for size, rec in sizes.items())
        engine.comms_logger.uninstall()
        with engine.gathered():
            params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
            dtypes = {n: p.dtype for n, p in engine.module.named_parameters()}
        # an explicit gather hands out the masters' values (cast to the compute dtype), also under qwZ
        exact = all(torch.equal(params[n], safe_get_full_fp32_param(p).to(dtypes[n]).float())
                    for n, p in engine.module.named_parameters())
        key = f"{stage}/{qwz}/{qgz}/{bf16}" + (f"/hpz{hpz}" if hpz > 1 else "")
        units = [u for u in engine.optimizer.units if not u.persistent] if stage == 3 else []
        out[key] = {"params": params, "bytes": by_op, "usage": engine.memory_usage(), "exact": exact,
                    "secondary_bound": sum(u.world * u.bucket.numel for u in units) * (2 if bf16 else 4)}
        engine.destroy()
    return out


def _reference() -> dict[str, torch.Tensor]:
    x, y = make_data(STEPS, GLOBAL_BATCH)
    model = train_reference(make_model(0), x, y, LR, CLIP)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _distance(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    diff = torch.cat([(params[n] - ref[n]).flatten() for n in ref])
    return float(diff.norm() / torch.cat([r.flatten() for r in ref.values()]).norm())


RUNS = [(3, False, False, False, 1), (3, True, False, False, 1), (3, False, True, False, 1), (3, True, True, False, 1),
        (2, False, True, False, 1), (3, False, False, True, 1), (3, True, False, True, 1)]
HPZ_RUNS = [(3, False, False, False, 2), (3, True, True, False, 2)]  # 2 nodes x 2: hpZ inside each node


@pytest.fixture(scope="module", params=[(2, 1), (4, 2)], ids=["2nodes_x1", "2nodes_x2"])
def results(request: pytest.FixtureRequest) -> tuple[int, dict[str, Any]]:
    world, local = request.param
    return world, run_distributed(train, world, local, RUNS + (HPZ_RUNS if local == 2 else []), timeout=600)[0]


def test_quantized_training_stays_near_the_reference(results: tuple[int, dict[str, Any]]) -> None:
    world, out = results
    ref = _reference()
    plain = _distance(out["3/False/False/False"]["params"], ref)
    assert plain <= 1e-5, plain
    assert all(r["exact"] for r in out.values()), {k: r["exact"] for k, r in out.items()}
    for key in ("3/True/False/False", "3/False/True/False", "3/True/True/False", "2/False/True/False"):
        g = _distance(out[key]["params"], ref)
        print(f"world {world} stage/qwZ/qgZ {key}: G = {g:.2e}")
        assert 1e-6 < g <= G_MAX, (key, g)


def test_qwz_gathers_int8(results: tuple[int, dict[str, Any]]) -> None:
    _, out = results
    plain, quant = out["3/False/False/True"]["bytes"], out["3/True/False/True"]["bytes"]
    gathered = {k: sum(v for n, v in b.items() if n.startswith("all_gather_into_tensor")) for k, b in
                (("plain", plain), ("qwz", quant))}
    ratio = gathered["qwz"] / gathered["plain"]
    print(f"qwZ all-gather bytes {gathered['qwz']} / bf16 {gathered['plain']} = {ratio:.3f}")
    assert 0 < ratio <= 0.55, gathered


def test_qgz_gradient_bytes_across_nodes(results: tuple[int, dict[str, Any]]) -> None:
    world, out = results
    plain, quant = out["3/False/False/False"]["bytes"], out["3/False/True/False"]["bytes"]
    plain_grads = sum(v for n, v in plain.items() if n.startswith("reduce_scatter_tensor"))
    assert plain_grads > 0 and not any(n.startswith("reduce_scatter_tensor") for n in quant), quant
    across = sum(v for n, v in quant.items() if n == "all_to_all_single | across nodes")
    inside = sum(v for n, v in quant.items() if n == "all_to_all_single | inside nodes")
    assert across > 0 and (inside > 0) == (world == 4), quant  # one rank a node: no step inside
    assert "all_to_all_single" not in quant, quant  # nothing at the world level
    ratio = across / plain_grads
    print(f"world {world}: qgZ gradient bytes across nodes {across} / plain reduce-scatter {plain_grads} = "
          f"{ratio:.3f}")
    assert 0 < ratio <= 0.3, (across, plain_grads)


def test_hpz_trains_exactly_and_keeps_backward_gathers_inside_nodes(results: tuple[int, dict[str, Any]]) -> None:
    """hpZ moves data, it does not round it: the reference's parameters within fp32 noise. The live
    budget (500 elements) releases every unit after its forward, so backward gathers them again:
    with hpZ from the secondary shards, over the 2 ranks of the node (the logger's "inside nodes"),
    and the world-level all-gathers are the forward's alone, about half of plain stage 3's."""
    world, out = results
    if world != 4:
        pytest.skip("hpZ needs several ranks a node (2 nodes x 2)")
    run, plain = out["3/False/False/False/hpz2"], out["3/False/False/False"]
    assert _distance(run["params"], _reference()) <= 1e-5
    world_gathers = {k: r["bytes"].get("all_gather_into_tensor", 0) for k, r in (("hpz", run), ("plain", plain))}
    inside = run["bytes"].get("all_gather_into_tensor | inside nodes", 0)
    print(f"hpZ all-gather bytes: world {world_gathers['hpz']} (plain stage 3: {world_gathers['plain']}), "
          f"inside nodes {inside}; secondary shard peak {run['usage']['secondary_shard_peak']} B")
    assert inside > 0 and world_gathers["hpz"] <= 0.55 * world_gathers["plain"], (world_gathers, inside)
    # memory_usage() counts the secondaries: at most 1/h of every released unit, gathered
    peak = run["usage"]["secondary_shard_peak"]
    assert 0 < peak <= run["secondary_bound"] // 2, (peak, run["secondary_bound"])
    assert "secondary_shard_peak" not in plain["usage"]
    # and `zeroshard estimate` predicts it (every unit released: persistence threshold 0)
    spec = spec_from_module(make_model(0), "test model")
    assert model_states(spec, 3, world, "fp32", persistence_threshold=0, hpz_partition_size=2).secondary == peak


def test_all_three_together(results: tuple[int, dict[str, Any]]) -> None:
    world, out = results
    if world != 4:
        pytest.skip("hpZ needs several ranks a node (2 nodes x 2)")
    g = _distance(out["3/True/True/False/hpz2"]["params"], _reference())
    print(f"qwZ + qgZ + hpZ: G = {g:.2e}")
    assert 1e-6 < g <= G_MAX, g


def bad_hpz(rank: int, world: int, local: int, size: int) -> str:
    os.environ["LOCAL_WORLD_SIZE"] = str(local)
    model = make_model(0)
    try:
        zeroshard.initialize(model=model, model_parameters=model.parameters(),
                             config=_config(3, False, False, False, size))
    except zeroshard.errors.ConfigError as e:
        return f"{e.key}: {e}"
    return "no error"


@pytest.mark.parametrize(("local", "size", "words"), [(2, 4, "zero_hpz_partition_size 4 does not divide the 2 ranks"),
                                                     (4, 3, "zero_hpz_partition_size 3 does not divide the 4 ranks")])
def test_an_hpz_size_that_does_not_divide_a_node(local: int, size: int, words: str) -> None:
    for message in run_distributed(bad_hpz, 4, local, size):
        assert message.startswith("zero_optimization.zero_hpz_partition_size: ") and words in message, message


def save_all_three(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    x, y = make_data(STEPS, GLOBAL_BATCH)
    micro = GLOBAL_BATCH // (GA * world)
    model = make_model(0)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                      config=_config(3, True, True, False, 2))
    for step in range(3):
        for m in range(GA):
            engine.backward(engine(*(micro_batch(t, step, m, rank, world, micro) for t in (x, y))))
            engine.step()
    engine.save_checkpoint(path, tag="zeropp")
    with engine.gathered():
        out = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return out


def load_flat(rank: int, world: int, path: str, stage: int) -> dict[str, Any]:
    x, y = make_data(STEPS, GLOBAL_BATCH)
    micro = GLOBAL_BATCH // (GA * world)
    model = make_model(0)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                      config=_config(stage, False, False, False))
    engine.load_checkpoint(path, tag="zeropp")
    with engine.gathered():
        loaded = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    steps = engine.global_steps
    for step in range(3, 5):  # and trains on from there
        for m in range(GA):
            engine.backward(engine(*(micro_batch(t, step, m, rank, world, micro) for t in (x, y))))
            engine.step()
    trained = engine.global_steps
    engine.destroy()
    return {"loaded": loaded, "steps": steps, "trained": trained}


def test_a_zeropp_checkpoint_loads_into_the_flat_layout(tmp_path: Path) -> None:
    """Saved by qwZ + qgZ + hpZ on 2 nodes x 2 (the fp32 masters: exact), loaded by plain stage 2
    on 2 ranks and stage 3 on 1: the same parameters, bit for bit, and training goes on."""
    saved = run_distributed(save_all_three, 4, str(tmp_path), timeout=600)[0]
    for world, stage in ((2, 2), (1, 3)):
        for r in run_distributed(load_flat, world, str(tmp_path), stage, timeout=600):
            assert r["steps"] == 3 and r["trained"] == 5, r
            assert all(torch.equal(r["loaded"][n], saved[n]) for n in saved), (world, stage)
