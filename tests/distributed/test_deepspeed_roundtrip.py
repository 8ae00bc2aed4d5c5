"""Round trips with the real DeepSpeed 0.19: DeepSpeed -> zeroshard (another world size) ->
``zeroshard convert --to deepspeed`` -> DeepSpeed, and a DeepSpeed offload checkpoint -> zeroshard.

One spawned DeepSpeed job (2 ranks, default FusedAdam, i.e. no ``torch_adam``) trains each run
``K`` steps and saves, then goes on uninterrupted for ``J + L`` steps, recording its fp32 masters
after ``K + J`` and ``K + J + L`` steps. zeroshard (3 ranks) resumes each checkpoint, trains ``J``
steps and saves; the test converts that back to DeepSpeed's layout for 2 ranks; a second DeepSpeed
job loads it (masters and Adam moments must equal zeroshard's bit for bit, and the gradient
clipping the job's: DeepSpeed's ZeRO-1/2 load adopts the file's ``clip_grad``, which one conversion
takes from zeroshard's checkpoint, the others from ``--ds-config``) and trains ``L`` steps.
At each hop the fp32 masters are compared with the uninterrupted run (relative norm of the
difference): fp32 runs within 1e-5; bf16 runs within ``BF16_TOL`` = 1e-3 because their bf16
forward and backward see other micro-batches at another world size (4 samples per rank instead of
6), so gradients differ by bf16 rounding (unit roundoff 2**-9 ≈ 2e-3) before the fp32 update
(measured: 1.5e-4 after the zeroshard hop, 3.2e-4 after the DeepSpeed one; fp32 3e-7). That the
conversion itself loses nothing is checked exactly: what DeepSpeed holds after loading equals
zeroshard's checkpoint bit for bit.
The offload run (ZeRO-2, ``offload_optimizer: cpu``, DeepSpeedCPUAdam) is resumed by a zeroshard
engine without offload and must match DeepSpeed's own continuation within 1e-5.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from models import make_data, make_model, micro_batch, relative_distance

import zeroshard
from zeroshard.checkpoint.open import open_source
from zeroshard.cli.main import main as cli

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="DeepSpeed is not installed (pip install zeroshard[deepspeed])")

K, J, L, GLOBAL_BATCH, GA = 2, 2, 2, 24, 2
DS_WORLD, ZS_WORLD = 2, 3
#: name -> (ZeRO stage, precision, offload): bf16 at every stage, one fp32 run, one offload run.
RUNS = {"s1_bf16": (1, "bf16", False), "s2_bf16": (2, "bf16", False), "s3_bf16": (3, "bf16", False),
        "s3_fp32": (3, "fp32", False), "s2_offload": (2, "fp32", True)}
FP32_TOL, BF16_TOL = 1e-5, 1e-3
#: not DeepSpeed's default: its ZeRO-1/2 load adopts the checkpoint's clip_grad over the job's setting
CLIP = 0.5
#: converted without --ds-config: clipping, stage and precision from zeroshard's checkpoint
NO_CONFIG = "s1_bf16"


def ds_config(stage: int, precision: str, offload: bool = False) -> dict:
    zero: dict = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    return {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": GA, "gradient_clipping": CLIP,
            "bf16": {"enabled": precision == "bf16"}, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}}}


def train(engine, steps: range, rank: int, world: int, dtype: torch.dtype) -> None:
    x, y = make_data(K + J + L, GLOBAL_BATCH)
    ga = engine.gradient_accumulation_steps()
    for step in steps:
        for m in range(ga):
            xb, yb = (micro_batch(t, step, m, rank, world, GLOBAL_BATCH // (ga * world)) for t in (x, y))
            engine.backward(engine(xb.to(dtype), yb))
            engine.step()


def _ds_masters(engine) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    # collectives at stage 3: every rank calls
    return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()}


def _deepspeed():
    import deepspeed

    # Skip DeepSpeed's JIT-compiled shared-memory all-reduce: gloo does the same job here.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    return deepspeed


def ds_uninterrupted(rank: int, world: int, root: str) -> dict:
    deepspeed = _deepspeed()
    out = {}
    for name, (stage, precision, offload) in RUNS.items():
        model = make_model(0)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(stage, precision, offload))
        expected = "DeepSpeedCPUAdam" if offload else "FusedAdam"
        assert type(engine.optimizer.optimizer).__name__ == expected, (name, type(engine.optimizer.optimizer))
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        train(engine, range(K), rank, world, dtype)
        engine.save_checkpoint(f"{root}/ds/{name}", client_state={"epoch": 7})
        train(engine, range(K, K + J), rank, world, dtype)
        out[f"{name}@{K + J}"] = _ds_masters(engine)
        train(engine, range(K + J, K + J + L), rank, world, dtype)
        out[f"{name}@{K + J + L}"] = _ds_masters(engine)
    return out


def zs_resume(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, (stage, precision, _offload) in RUNS.items():
        cfg = ds_config(stage, precision)  # no offload: zeroshard resumes the offload run without it
        engine, *_ = zeroshard.initialize(model=make_model(5), config=cfg)
        _path, client = engine.load_checkpoint(f"{root}/ds/{name}")
        assert engine.global_steps == K and client["epoch"] == 7, (name, engine.global_steps)
        train(engine, range(K, K + J), rank, world, torch.float32)  # zeroshard casts inputs itself
        engine.save_checkpoint(f"{root}/zs/{name}", client_state={"epoch": 8})
        out[name] = engine.global_steps
    return out


def ds_resume(rank: int, world: int, root: str) -> dict:
    deepspeed = _deepspeed()
    out = {}
    for name, (stage, precision, _offload) in RUNS.items():
        if name == "s2_offload":
            continue
        model = make_model(9)  # other initial weights: everything must come from the checkpoint
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(stage, precision))
        _path, client = engine.load_checkpoint(f"{root}/back/{name}")
        assert engine.global_steps == K + J and client["epoch"] == 8, (name, engine.global_steps, client.get("epoch"))
        assert engine.lr_scheduler.last_batch_iteration == K + J - 1
        # what DeepSpeed holds after loading, through its own save: compared with zeroshard's file
        engine.save_checkpoint(f"{root}/reloaded/{name}", tag="reloaded", save_latest=False)
        out[f"{name} clip_grad"] = getattr(engine.optimizer, "clip_grad", CLIP)  # ZeRO-3 keeps the job's
        train(engine, range(K + J, K + J + L), rank, world, torch.bfloat16 if precision == "bf16" else torch.float32)
        out[f"{name}@{K + J + L}"] = _ds_masters(engine)
    return out


def test_deepspeed_zeroshard_deepspeed(tmp_path: Path) -> None:
    root = str(tmp_path)
    ref = run_distributed(ds_uninterrupted, DS_WORLD, root, timeout=900)[0]
    assert run_distributed(zs_resume, ZS_WORLD, root, timeout=600)[0] == dict.fromkeys(RUNS, K + J)
    report = []
    for name, (stage, precision, _offload) in RUNS.items():
        tol = BF16_TOL if precision == "bf16" else FP32_TOL
        zs = zeroshard.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "zs" / name)
        rel = relative_distance(zs, ref[f"{name}@{K + J}"])
        report.append(f"{name}: DeepSpeed x{DS_WORLD} -> zeroshard x{ZS_WORLD}, {J} steps: rel {rel:.1e}")
        assert rel <= tol, report[-1]
        if name == "s2_offload":
            continue
        cfg = tmp_path / f"{name}.json"
        cfg.write_text(json.dumps(ds_config(stage, precision)))
        config = [] if name == NO_CONFIG else ["--ds-config", str(cfg)]
        assert cli(["convert", str(tmp_path / "zs" / name), str(tmp_path / "back" / name), "--to", "deepspeed",
                    "--world-size", str(DS_WORLD), *config, "--quiet"]) == 0
    back = run_distributed(ds_resume, DS_WORLD, root, timeout=900)[0]
    for name, (_stage, precision, _offload) in RUNS.items():
        if name == "s2_offload":
            continue
        with (open_source(tmp_path / "zs" / name / f"global_step{K + J}") as zs,
              open_source(tmp_path / "reloaded" / name / "reloaded") as ds):
            assert ds.counters["global_steps"] == K + J
            for n, p in zs.params.items():  # bit for bit: fp32 masters, Adam moments and step
                for key in ("master", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(ds.read(key, n, 0, p.numel), zs.read(key, n, 0, p.numel)), (name, key, n)
                assert float(ds.read_scalar("step", n)) == float(zs.read_scalar("step", n)) == K + J, (name, n)
        assert back[f"{name} clip_grad"] == CLIP, (name, back[f"{name} clip_grad"])
        rel = relative_distance(back[f"{name}@{K + J + L}"], ref[f"{name}@{K + J + L}"])
        report.append(f"{name}: -> DeepSpeed x{DS_WORLD}, {L} steps: rel {rel:.1e}")
        assert rel <= (BF16_TOL if precision == "bf16" else FP32_TOL), report[-1]
    print("\n".join(report))
