"""The public API as a DeepSpeed user drives it: tutorial loop, client optimizers, accessors, errors."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import log_lines, run_distributed
from models import make_data, make_model

import zeroshard

SHARED_CONFIGS = Path(__file__).resolve().parents[3] / "shared" / "configs"


class Classifier(torch.nn.Module):
    """The shape of DeepSpeed's CIFAR tutorial model: float inputs in, logits out."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(12, 33), torch.nn.ReLU(), torch.nn.Linear(33, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def tutorial_worker(rank: int, world: int) -> dict:
    """DeepSpeed's tutorial loop with a bf16 config, unchanged but for the import."""
    import zeroshard as deepspeed

    torch.manual_seed(0)
    x = torch.randn(64, 12)
    labels = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    trainset = torch.utils.data.TensorDataset(x, labels)
    net = Classifier()
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "Adam", "params": {"lr": 3e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 3e-2}},
    }
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        model=net, model_parameters=net.parameters(), training_data=trainset, config=cfg
    )
    criterion = torch.nn.CrossEntropyLoss()
    losses, seen = [], []
    for _epoch in range(6):
        trainloader.sampler.set_epoch(_epoch)
        for inputs, target in trainloader:
            assert inputs.shape[0] == 4
            seen.append(inputs[:, 0].clone())
            outputs = model_engine(inputs.to(model_engine.device))  # fp32 inputs, bf16 model
            loss = criterion(outputs.float(), target.to(model_engine.device))
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
    return {
        "first": sum(losses[:8]) / 8,
        "last": sum(losses[-8:]) / 8,
        "epoch0_inputs": torch.cat(seen[: 64 // (4 * world)]),
        "lr": optimizer.param_groups[0]["lr"],
        "dtype": str(next(model_engine.module.parameters()).dtype),
    }


def test_deepspeed_tutorial_loop_bf16() -> None:
    results = run_distributed(tutorial_worker, 2)
    for r in results:
        assert r["dtype"] == "torch.bfloat16"
        assert r["last"] < 0.7 * r["first"], r
        assert r["lr"] == pytest.approx(3e-2)
    # The DistributedSampler gives each rank a disjoint half of the data in an epoch.
    a, b = results[0]["epoch0_inputs"], results[1]["epoch0_inputs"]
    assert a.numel() == b.numel() == 32
    assert not set(a.tolist()) & set(b.tolist())


def accessors_worker(rank: int, world: int) -> dict:
    model = make_model(0)
    client_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cfg = {"train_batch_size": 8, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
           "zero_optimization": {"stage": 1}}
    engine, opt, loader, sched = zeroshard.initialize(
        model=model, optimizer=client_opt, lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5),
        config=cfg,
    )
    x, y = make_data(1, 8)
    boundaries = []
    for m in range(2):
        xb, yb = x[0, m * 4 + rank * 2 : m * 4 + rank * 2 + 2], y[0, m * 4 + rank * 2 : m * 4 + rank * 2 + 2]
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(xb, yb))
        engine.step()
    return {
        "boundaries": torch.tensor(boundaries),
        "steps": engine.global_steps,
        "micro": engine.train_micro_batch_size_per_gpu(),
        "gas": engine.gradient_accumulation_steps(),
        "world": engine.world_size,
        "rank": engine.global_rank,
        "lr": engine.get_lr()[0],
        "norm": engine.get_global_grad_norm(),
        "same_optimizer": opt.optimizer is client_opt,
        "loader_is_none": loader is None,
        "scale": engine.cur_scale,
        "momentum_state": sum(s["momentum_buffer"].numel() for s in client_opt.state.values()),
        "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
    }


def test_client_optimizer_scheduler_and_accessors() -> None:
    results = run_distributed(accessors_worker, 2)
    # Reference: plain torch SGD with momentum on the global batch, clipped at 0.5.
    model = make_model(0)
    x, y = make_data(1, 8)
    model(x[0], y[0]).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item()
    torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9).step()
    psi = sum(p.numel() for p in model.parameters())
    for r in results:
        assert r["boundaries"].tolist() == [False, True]
        assert (r["steps"], r["micro"], r["gas"], r["world"], r["scale"]) == (1, 2, 2, 2, 1.0)
        assert r["lr"] == pytest.approx(0.05)  # the client StepLR stepped once
        assert r["norm"] == pytest.approx(ref_norm, rel=1e-5)
        assert r["same_optimizer"] and r["loader_is_none"]
        # Stage 1: each rank keeps momentum for about half of the parameters.
        assert psi / 2 - 8 <= r["momentum_state"] <= psi / 2 + 8
        for n, p in model.named_parameters():
            torch.testing.assert_close(r["params"][n], p.detach(), rtol=1e-5, atol=1e-6)
    assert sorted(r["rank"] for r in results) == [0, 1]


def errors_worker(rank: int, world: int) -> list[tuple[str, str | None, str]]:
    cases = {
        "batch": {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8},
        "unknown": {"train_batch_size": 8, "zero_optimisation": {"stage": 1}},
        "type": {"train_batch_size": 8, "zero_optimization": {"stage": "two"}},
        # partial optimizer offload below stage 3 (DeepSpeed's validator refuses it too): named
        "offload": {"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": {
            "device": "cpu", "ratio": 0.5}}},
        "feature": {"train_batch_size": 8, "pipeline": {"stages": 2}},
        "no_optimizer": {"train_batch_size": 8},
        "auto": {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
    }
    out = []
    for name, cfg in cases.items():
        model = make_model(0)
        try:
            engine, *_ = zeroshard.initialize(model=model, config=cfg)
            if name == "no_optimizer":  # an evaluation engine, as DeepSpeed's: training it is the error
                x, y = make_data(1, 8)
                engine.backward(engine(x[0, :4], y[0, :4]))
                engine.step()
        except zeroshard.ConfigError as e:
            out.append((name, e.key, f"{type(e).__name__}: {e}"))
        else:
            out.append((name, "no error", ""))
    return out


def test_config_errors_name_the_key() -> None:
    errors = {name: (key, msg) for name, key, msg in run_distributed(errors_worker, 2)[0]}
    assert "32 != " in errors["batch"][1] and "2 ranks" in errors["batch"][1]
    assert "zero_optimisation" in errors["unknown"][1] and "zero_optimization" in errors["unknown"][1]
    assert errors["type"][0] == "zero_optimization.stage"
    assert errors["offload"][0] == "zero_optimization.offload_optimizer.ratio"
    assert "ConfigError" in errors["offload"][1] and "stage 3" in errors["offload"][1], errors["offload"]
    assert "pipeline" in errors["feature"][1]
    assert errors["no_optimizer"][0] == "optimizer"
    assert errors["auto"][0] == "optimizer.params.lr" or "optimizer.params.lr" in errors["auto"][1]


def reference_model_worker(rank: int, world: int, stage: int) -> dict[str, Any]:
    """TRL's DPO/PPO set-up: a policy trained beside a reference model frozen whole
    (``create_reference_model()``), wrapped by ``initialize`` without any optimizer, as
    ``prepare_deepspeed`` does."""
    x, y = make_data(3, 8)
    ref_model = make_model(1).requires_grad_(False).eval()
    ref, *_ = zeroshard.initialize(model=ref_model, config={"train_micro_batch_size_per_gpu": 4,
                                                           "zero_optimization": {"stage": stage}})
    policy = make_model(0)
    engine, *_ = zeroshard.initialize(model=policy, config={
        "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    ref_losses = []
    for step in range(3):
        xb, yb = x[step, rank * 4 : rank * 4 + 4], y[step, rank * 4 : rank * 4 + 4]
        with torch.no_grad():
            ref_losses.append(ref(xb, yb).item())
        engine.backward(engine(xb, yb))
        engine.step()
    try:
        ref.step()
        step_error = None
    except zeroshard.ConfigError as e:
        step_error = e.key
    return {"ref_losses": ref_losses, "step_error": step_error,
            "ref_shard": ref.memory_usage().get("frozen_parameter_shard", 0)}


@pytest.mark.parametrize("stage", [0, 3])
def test_reference_model_frozen_whole_without_optimizer(stage: int) -> None:
    results = run_distributed(reference_model_worker, 2, stage)
    x, y = make_data(3, 8)
    plain = make_model(1)
    full_bytes = sum(p.numel() * 4 for p in plain.parameters())
    for rank, r in enumerate(results):
        with torch.no_grad():
            expect = [plain(x[s, rank * 4 : rank * 4 + 4], y[s, rank * 4 : rank * 4 + 4]).item() for s in range(3)]
        assert r["ref_losses"] == pytest.approx(expect, rel=1e-6)
        assert r["step_error"] == "optimizer"
        if stage == 3:  # partitioned like any frozen base: about half per rank (chunks are padded)
            assert 0.45 * full_bytes <= r["ref_shard"] <= 0.6 * full_bytes, (r["ref_shard"], full_bytes)


def client_wins_worker(rank: int, world: int) -> dict[str, Any]:
    """DeepSpeedExamples' GAN script: an optimizer block in the config and a client optimizer (and
    scheduler) passed too. DeepSpeed uses the client's; so does zeroshard, saying so."""
    warnings = log_lines(logging.WARNING)
    model = make_model(0)
    client = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1.0}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}
    engine, opt, _, sched = zeroshard.initialize(
        model=model, optimizer=client, config=cfg,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    x, y = make_data(1, 8)
    engine.backward(engine(x[0, rank * 4 : rank * 4 + 4], y[0, rank * 4 : rank * 4 + 4]))
    engine.step()
    return {"inner": type(opt.optimizer).__name__, "name": engine.optimizer_name(), "lr": engine.get_lr(),
            "scheduler": type(sched).__name__, "scheduler_name": engine.scheduler_name(),
            "warnings": [w for w in warnings if "is not used" in w]}


def test_client_optimizer_and_scheduler_win_over_the_config_blocks() -> None:
    results = run_distributed(client_wins_worker, 2)
    for rank, r in enumerate(results):
        assert r["inner"] == "SGD" and r["name"] == "SGD" and r["scheduler"] == "StepLR", r
        assert r["scheduler_name"] is None and r["lr"] == [pytest.approx(0.05)], r
        said = r["warnings"]
        if rank == 0:
            assert len(said) == 2 and "'optimizer'" in said[0] and "AdamW" in said[0] and "WarmupLR" in said[1], said
        else:
            assert not said, said


def parameter_forms_worker(rank: int, world: int) -> dict[str, Any]:
    """``model_parameters`` in each form torch's optimizers take; the decay/no-decay split of
    Hugging Face scripts by name. Each trains one step at stage 3 (its groups' sizes and settings
    kept), or fails with a ConfigError naming ``model_parameters``."""
    cfg = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    forms: dict[str, Any] = {
        "named_parameters()": lambda m: m.named_parameters(),
        "a one-shot filter": lambda m: filter(lambda p: p.requires_grad, m.parameters()),
        "one tensor": lambda m: m.out.weight,
        "named groups": lambda m: [
            {"params": [(n, p) for n, p in m.named_parameters() if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [(n, p) for n, p in m.named_parameters() if not n.endswith("weight")], "weight_decay": 0.0}],
        "a group of one tensor": lambda m: [{"params": m.out.weight}, {"params": [m.out.bias], "lr": 0.5}],
        "names only": lambda m: [n for n, _ in m.named_parameters()],
        "a group without params": lambda m: [{"weights": list(m.parameters())}],
    }
    x, y = make_data(1, 8)
    out: dict[str, Any] = {}
    for name, form in forms.items():
        model = make_model(0)
        try:
            engine, *_ = zeroshard.initialize(model=model, model_parameters=form(model), config=cfg)
        except zeroshard.ConfigError as e:
            out[name] = f"ConfigError {e.key}: {e}"
            continue
        engine.backward(engine(x[0, rank * 4 : rank * 4 + 4], y[0, rank * 4 : rank * 4 + 4]))
        engine.step()
        out[name] = [(len(g["params"]), g["lr"], g["weight_decay"]) for g in engine.optimizer.param_groups]
    return out


def test_model_parameters_in_every_form_torch_takes() -> None:
    out = run_distributed(parameter_forms_worker, 2)[0]
    every = [(8, 1e-2, 0.0)]  # ToyNet: 8 parameters, the config's lr, DeepSpeed's default decay 0
    assert out["named_parameters()"] == every and out["a one-shot filter"] == every
    assert out["one tensor"] == [(1, 1e-2, 0.0)]
    assert out["named groups"] == [(4, 1e-2, 0.1), (4, 1e-2, 0.0)]
    assert out["a group of one tensor"] == [(1, 1e-2, 0.0), (1, 0.5, 0.0)]
    assert "model_parameters" in out["names only"] and "param group 0 holds a str" in out["names only"]
    assert "model_parameters" in out["a group without params"] and "no 'params' key" in out["a group without params"]


def shared_configs_worker(rank: int, world: int, names: list[str], nvme: str) -> dict[str, str]:
    out = {}
    for name in names:
        path = SHARED_CONFIGS / name
        raw = json.loads(path.read_text())
        if "nvme" in path.read_text():  # the one change: this machine has no /local/nvme
            for block in ("offload_optimizer", "offload_param"):
                if raw["zero_optimization"].get(block, {}).get("nvme_path"):
                    raw["zero_optimization"][block]["nvme_path"] = nvme
            path = Path(nvme) / f"{rank}-{name}"
            path.write_text(json.dumps(raw))
        model = make_model(0)
        # Configs without an optimizer block expect the client to pass one (zero3_tuned.json says so).
        client = None if "optimizer" in raw else (lambda groups: torch.optim.AdamW(groups, lr=1e-3))
        autos = {k: v for k, v in (("lr", 1e-3), ("weight_decay", 0.0))
                 if raw.get("optimizer", {}).get("params", {}).get(k) == "auto"}
        try:
            engine, _, _, _ = zeroshard.initialize(
                model=model, config=str(path), optimizer=client,
                auto_values={f"optimizer.params.{k}": v for k, v in autos.items()},
            )
        except zeroshard.NotYetSupportedError as e:
            out[name] = f"not yet supported: {e.key}"
            continue
        x, y = make_data(3, engine.train_batch_size())
        micro = engine.train_micro_batch_size_per_gpu()
        with engine.gathered():
            before = [p.detach().clone() for p in engine.module.parameters()]
        for step in range(3):
            for m in range(engine.gradient_accumulation_steps()):
                a = (m * world + rank) * micro
                engine.backward(engine(x[step, a : a + micro], y[step, a : a + micro]))
                engine.step()
        with engine.gathered():
            moved = any(not torch.equal(b, p) for b, p in zip(before, engine.module.parameters()))
        out[name] = f"trained {engine.global_steps} steps, moved={moved}, dtype={next(model.parameters()).dtype}"
    return out


@pytest.mark.skipif(not SHARED_CONFIGS.is_dir(), reason="../shared/configs is not beside the checkout")
def test_shared_configs_train(tmp_path: Path) -> None:
    names = sorted(p.name for p in SHARED_CONFIGS.glob("*.json"))
    out = run_distributed(shared_configs_worker, 2, names, str(tmp_path))[0]
    print(out)
    assert out["zero2_fp16_adamw.json"] == "trained 3 steps, moved=True, dtype=torch.float16"
    assert out["zero2_bf16_warmupdecay.json"] == "trained 3 steps, moved=True, dtype=torch.bfloat16"
    assert out["zero3_tuned.json"] == "trained 3 steps, moved=True, dtype=torch.float16"
    assert out["zero3_offload_cpu.json"] == "trained 3 steps, moved=True, dtype=torch.float16", out
    assert out["zero_infinity_nvme.json"] == "trained 3 steps, moved=True, dtype=torch.bfloat16", out


def test_plain_python_is_a_world_of_one(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, zeroshard\n"
        "model = torch.nn.Linear(3, 2)\n"
        "cfg = {'train_batch_size': 2, 'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}}}\n"
        "engine, *_ = zeroshard.initialize(model=model, config=cfg)\n"
        "engine.backward(engine(torch.randn(2, 3)).sum()); engine.step()\n"
        "print('world', engine.world_size, 'steps', engine.global_steps)\n"
    )
    launcher_vars = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "world 1 steps 1" in done.stdout


def _rank_seeded_model(rank: int) -> torch.nn.Module:
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 3))
    model[1].running_mean.uniform_()
    model.register_buffer("counter", torch.tensor([rank, 2 * rank], dtype=torch.int64))
    return model


def broadcast_worker(rank: int, world: int) -> dict:
    from zeroshard.core.comm.collectives import broadcast_coalesced

    out = {}
    for stage in (0, 2):
        cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
               "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        engine, *_ = zeroshard.initialize(model=_rank_seeded_model(rank), config=cfg)
        out[stage] = {k: v.clone() for k, v in engine.module.state_dict().items()}
    # Tiny buckets (several messages per dtype), mixed dtypes, a non-contiguous tensor.
    torch.manual_seed(10 + rank)
    tensors = [torch.randn(4, 3).t(), torch.randn(5).to(torch.bfloat16), torch.randn(9), torch.arange(3) * rank]
    broadcast_coalesced(tensors, src=0, group=None, bucket_bytes=24)
    out["direct"] = [t.clone() for t in tensors]
    return out


def test_initialize_broadcasts_rank0_weights_and_buffers() -> None:
    """Ranks that built different weights train rank 0's, as DeepSpeed and DDP do."""
    results = run_distributed(broadcast_worker, 2)
    want = _rank_seeded_model(0).state_dict()
    for rank in (0, 1):
        for stage in (0, 2):
            got = results[rank][stage]
            assert set(got) == set(want)
            for k, v in want.items():
                assert torch.equal(got[k], v), (rank, stage, k)
        for a, b in zip(results[rank]["direct"], results[0]["direct"]):
            assert a.dtype == b.dtype and torch.equal(a, b), rank
    assert not torch.equal(_rank_seeded_model(1)[0].weight, want["0.weight"])
