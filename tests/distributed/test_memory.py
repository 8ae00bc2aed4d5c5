"""Bytes held per rank follow the ZeRO formulas (stages 0–3) (Adam, 16-bit compute, Ψ parameters, N ranks).

With gradients accumulated in the compute dtype (``data_types.grad_accum_dtype: bf16``) the
classic formulas hold: stage 1 holds 2Ψ + 2Ψ + 12Ψ/N bytes, stage 2 holds 2Ψ + 14Ψ/N. With the
default fp32 accumulation the gradient term doubles (4Ψ at stage 1, 4Ψ/N at stage 2). Padding
adds at most N − 1 elements per parameter tensor, and fused Adam keeps a 4-byte step counter per
tensor: those are the only allowed differences.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from torch import nn

import zeroshard
from zeroshard.estimate.model_spec import spec_from_module
from zeroshard.estimate.states import model_states


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(301, 257), nn.GELU(), nn.Linear(257, 129), nn.Linear(129, 3))


def memory_worker(rank: int, world: int) -> dict[str, dict[str, int]]:
    out = {}
    for stage in (0, 1, 2, 3):
        for accum in ("bf16", "fp32"):
            model = _model()
            cfg = {
                "train_micro_batch_size_per_gpu": 2,
                "bf16": {"enabled": True},
                "data_types": {"grad_accum_dtype": accum},
                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            }
            engine, _, _, _ = zeroshard.initialize(model=model, config=cfg)
            loss = engine(torch.randn(2, 301)).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            out[f"{stage}/{accum}"] = engine.memory_usage()
        # fp32 training: the module's parameters are the master weights.
        model = _model()
        cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
        engine, _, _, _ = zeroshard.initialize(model=model, config=cfg)
        engine.backward(engine(torch.randn(2, 301)).pow(2).mean())
        engine.step()
        out[f"{stage}/fp32-training"] = engine.memory_usage()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_memory_follows_zero_formulas(world: int) -> None:
    results = run_distributed(memory_worker, world)
    shapes = [p.numel() for p in _model().parameters()]
    psi, n, tensors = sum(shapes), world, len(shapes)
    for key, mem in results[0].items():
        stage, accum = int(key.split("/")[0]), key.split("/")[1]
        if accum == "fp32-training":
            if stage == 3:
                continue
            # ZeRO's fp32 formulas: 4Ψ params + 4Ψ gradients (4Ψ/N at stage 2) + Adam 8Ψ (/N from stage 1).
            shard = 1 if stage == 0 else n
            want = 4 * psi + 4 * psi / (n if stage == 2 else 1) + 8 * psi / shard
            assert mem["master_weights"] == 0, (key, mem)
            assert abs(mem["total"] - want) / want < 0.01, (key, mem, want)
            continue
        a = 2 if accum == "bf16" else 4
        shard = 1 if stage == 0 else n
        expected = {
            # Stage 3 at rest: an empty placeholder in the module, the 16-bit shard beside it.
            "parameters": 0 if stage == 3 else 2 * psi,
            "gradients": a * psi / (n if stage >= 2 else 1),
            "master_weights": 4 * psi / shard,
            "optimizer_states": 8 * psi / shard,
        }
        if stage == 3:
            # Units are gathered from the fp32 masters, cast chunk by chunk: no 16-bit shard is kept.
            assert "parameter_shard" not in mem, (key, mem)
        slack = {
            "parameters": 0,
            "parameter_shard": 2 * tensors,
            "gradients": a * n * tensors,
            "master_weights": 4 * tensors,
            "optimizer_states": 8 * tensors + 4 * tensors,  # padding of rank 0's chunks + step counters
        }
        for k, want in expected.items():
            assert want - 1 <= mem[k] <= want + slack[k] + 1, f"stage {stage} {accum} {k}: {mem[k]} vs {want}"
        total = sum(expected.values())
        assert abs(mem["total"] - total) / total < 0.01, (key, mem, total)
    # The estimator's communication buffers are the engine's, byte for byte at every stage (stages
    # 1-2 gather in place, stages 2-3 reduce through two buffers of half reduce_bucket_size, stage 3
    # in runs of units padded parameter by parameter).
    spec = spec_from_module(_model(), "mlp")
    for key, mem in results[0].items():
        stage, accum = int(key.split("/")[0]), key.split("/")[1]
        if accum != "fp32-training":
            assert model_states(spec, stage, n, "bf16", accum).workspace == mem["comm_workspace"], (key, mem)
    # Sharding really shrinks what each rank holds; stage 3 with bf16 accumulation is 14Ψ/N (the
    # ZeRO paper's 16Ψ/N less the 16-bit parameter shard, which stage 3 does not keep).
    r = results[0]
    assert r["3/bf16"]["total"] < r["2/bf16"]["total"] < r["1/bf16"]["total"] < r["0/bf16"]["total"]
    assert abs(r["3/bf16"]["total"] - 14 * psi / n) / (14 * psi / n) < 0.01
    # Peak gathered parameters: at most the whole model in bf16 here (default live budget).
    assert 0 < r["3/bf16"]["gathered_peak"] <= 2 * psi


def bucket_worker(rank: int, world: int, reduce_bucket: int) -> dict[str, dict[str, int]]:
    """Stages 2-3 with many small layers, with and without ``overlap_comm``: the bucket buffers'
    bytes after one step."""
    out = {}
    for stage in (2, 3):
        for overlap in (False, True):
            torch.manual_seed(0)
            model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(24)])  # 4,160 elements per layer
            cfg = {"train_micro_batch_size_per_gpu": 2,
                   "zero_optimization": {"stage": stage, "reduce_bucket_size": reduce_bucket,
                                         "overlap_comm": overlap, "stage3_param_persistence_threshold": 0},
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
            engine, _, _, _ = zeroshard.initialize(model=model, config=cfg)
            engine.backward(engine(torch.randn(2, 64)).pow(2).mean())
            engine.step()
            out[f"stage {stage}, overlap_comm {overlap}"] = {
                "workspace": engine.optimizer.sync.workspace_bytes(),
                "reductions": len(engine.optimizer.sync.buckets)}
    return out


def test_reduce_buffers_hold_reduce_bucket_size_elements() -> None:
    """DeepSpeed's ``reduce_bucket_size`` is the elements reduced at a time: stages 2-3 keep two
    buffers that together hold at most that many (one fills while the other is reduced), with
    ``overlap_comm`` or without it (then each bucket is reduced as it fills, not all at the end
    of backward, which would hold the whole model's gradients)."""
    reduce_bucket = 40_000  # about 9.6 layers: each half-size buffer holds 4 of them
    results = run_distributed(bucket_worker, 2, reduce_bucket)
    assert len(results[0]) == 4
    for key, got in results[0].items():
        assert 0 < got["workspace"] <= reduce_bucket * 4, (key, got)
        # The model's 24 layers travel in buffers of 4 layers: 6 reductions, not 3 of 8.
        assert got["reductions"] == 6, (key, got)
