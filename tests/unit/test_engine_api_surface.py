"""The engine-API data file, DeepSpeed's module surface, and ``initialize``'s keywords (one process)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zeroshard
from zeroshard.deepspeed.engine import ZeroEngine
from zeroshard.deepspeed.engine_api import API_DATA, NOT_YET_SUPPORTED
from zeroshard.errors import ConfigError, NotYetSupportedError

ROOT = Path(__file__).resolve().parents[2]


def _methods() -> list[dict]:
    return json.loads(API_DATA.read_text())["methods"]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs DeepSpeed's source")
def test_data_file_is_regenerated_from_deepspeed() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_deepspeed_engine_api.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_every_deepspeed_method_works_or_says_why() -> None:
    methods = _methods()
    assert len(methods) >= 170  # DeepSpeed 0.19.8 defines 180 public names on DeepSpeedEngine
    for e in methods:
        assert e["status"] in ("works", "not-yet-supported"), e
        assert hasattr(ZeroEngine, e["name"]), e["name"]
        if e["status"] == "not-yet-supported":
            assert e["reason"] == NOT_YET_SUPPORTED[e["name"]]
            with pytest.raises(NotYetSupportedError, match=f"engine.{e['name']}\\(\\)") as info:
                getattr(ZeroEngine, e["name"])(object())
            assert info.value.key == e["name"]
    assert set(NOT_YET_SUPPORTED) <= {e["name"] for e in methods}, "a row for a name DeepSpeed does not have"
    assert {e["name"]: e["kind"] for e in methods}["loss_scale"] == "method"  # DeepSpeed: engine.loss_scale()


def test_signatures_of_methods_scripts_call() -> None:
    import inspect

    for name, params in (("step", ["lr_kwargs"]), ("backward", ["loss", "retain_graph", "scale_wrt_gas"]),
                         ("save_checkpoint", ["save_dir", "tag", "client_state", "save_latest",
                                              "exclude_frozen_parameters"]),
                         ("load_checkpoint", ["load_dir", "tag", "load_module_strict", "load_optimizer_states",
                                              "load_lr_scheduler_states", "load_module_only", "custom_load_fn"]),
                         ("set_train_batch_size", ["train_batch_size"]),
                         ("module_state_dict", ["destination", "prefix", "keep_vars", "exclude_frozen_parameters"])):
        assert list(inspect.signature(getattr(ZeroEngine, name)).parameters)[1:] == params, name


def test_fresh_import_has_deepspeed_submodules() -> None:
    code = ("import zeroshard as ds; ds.comm.get_rank; ds.accelerator.get_accelerator; ds.utils.log_dist; "
            "ds.utils.safe_get_full_grad; ds.zero.register_external_parameter; ds.add_config_arguments; "
            "ds.DeepSpeedConfig; import sys; print(sorted(m for m in sys.modules if m.startswith('deepspeed')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"  # nothing of DeepSpeed itself is imported


def test_comm_outside_a_process_group() -> None:
    from zeroshard.deepspeed import comm

    assert (comm.get_rank(), comm.get_world_size(), comm.is_available()) == (0, 1, True)
    comm.barrier()  # a world of one: nothing to wait for
    assert comm.ReduceOp.SUM is torch.distributed.ReduceOp.SUM


def test_accelerator_on_this_machine() -> None:
    from zeroshard.deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    cuda = torch.cuda.is_available()
    assert acc.device_name() == ("cuda" if cuda else "cpu")
    assert acc.communication_backend_name() == ("nccl" if cuda else "gloo")
    assert acc.is_available() and acc.device_count() >= 1 and acc.memory_allocated() > 0
    assert acc.is_bf16_supported() in (True, False) and acc.on_accelerator(torch.zeros(1, device=acc.device_name()))
    acc.manual_seed(3)
    a = torch.rand(2, device=acc.device_name())
    acc.manual_seed(3)
    assert torch.equal(a, torch.rand(2, device=acc.device_name()))
    with pytest.raises(NotYetSupportedError, match="create_graph"):
        acc.create_graph()
    with pytest.raises(AttributeError):
        acc.no_such_method()  # noqa: B018


def test_log_dist(caplog: pytest.LogCaptureFixture) -> None:
    from zeroshard.deepspeed.utils import log_dist

    with caplog.at_level(logging.INFO, logger="zeroshard"):
        log_dist("hello", ranks=[0])
    assert "hello" in caplog.text  # no process group: logged, as DeepSpeed


def test_add_config_arguments_and_deepspeed_config(tmp_path: Path) -> None:
    parser = zeroshard.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "c.json"])
    assert (args.deepspeed, args.deepspeed_config, args.deepscale, args.deepscale_config) == (True, "c.json", False,
                                                                                                None)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
                                "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {}}}))
    cfg = zeroshard.DeepSpeedConfig(str(path), world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (8, 2, 2)
    assert (cfg.zero_enabled, cfg.zero_optimization_stage, cfg.bfloat16_enabled, cfg.fp16_enabled) == (True, 2, True,
                                                                                                      False)
    assert cfg.optimizer_name == "AdamW" and cfg.zero_config.stage == 2 and cfg.gradient_clipping == 1.0
    with pytest.raises(zeroshard.ConfigError, match="zero_optimization.stag"):
        zeroshard.DeepSpeedConfig({"train_batch_size": 8, "zero_optimization": {"stag": 2}})


def test_register_external_parameter_arguments() -> None:
    from zeroshard.zero import register_external_parameter, unregister_external_parameter

    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    register_external_parameter(a, b.weight)
    register_external_parameter(a, b.weight)  # twice: registered once
    assert a.__dict__["_zeroshard_external_params"] == [b.weight]
    a(torch.zeros(1, 2))  # without an engine the hooks do nothing
    unregister_external_parameter(a, b.weight)
    with pytest.raises(ValueError, match="not registered"):
        unregister_external_parameter(a, b.weight)
    with pytest.raises(TypeError, match="nn.Parameter"):
        register_external_parameter(a, torch.zeros(2))


def test_unknown_initialize_keyword_is_an_error() -> None:
    with pytest.raises(TypeError, match="did you mean 'config'"):
        zeroshard.initialize(model=torch.nn.Linear(2, 2), confg={})
    with pytest.raises(TypeError, match="valid keywords: args, model"):
        zeroshard.initialize(model=torch.nn.Linear(2, 2), xyzzy=1)
    with pytest.raises(NotYetSupportedError, match="mpu"):
        zeroshard.initialize(model=torch.nn.Linear(2, 2), mpu=object(), config={})
    with pytest.raises(NotYetSupportedError, match="mesh_param"):
        zeroshard.initialize(model=torch.nn.Linear(2, 2), mesh_param=(2, 1), config={})


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_optimizer_attributes_scripts_read(stage: int, process_group: None) -> None:
    """``engine.optimizer`` answers DeepSpeed's ZeRO-optimizer names for the loss scale; its
    ``state_dict`` is this rank's part, as DeepSpeed's (Lightning builds it while saving a checkpoint:
    it was an error), and ``load_state_dict`` an error naming the checkpoint API."""
    model = torch.nn.Linear(4, 2)
    engine, optimizer, _, _ = zeroshard.initialize(model=model, config={
        "train_batch_size": 2, "fp16": {"enabled": True, "initial_scale_power": 8},
        "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert optimizer is engine.optimizer
    assert optimizer.cur_scale == optimizer.loss_scale == engine.cur_scale == 256.0
    optimizer.cur_scale = 64.0  # DeepSpeed's properties have setters too
    assert engine.cur_scale == optimizer.loss_scale == 64.0
    sd = optimizer.state_dict()
    assert (sd["zero_stage"], sd["partition_count"], sd["rank"], sd["loss_scaler"]["scale"]) == (stage, 1, 0, 64.0)
    assert sorted(t.numel() for t in sd["fp32_master_shard"]) == [2, 8]  # the weight and the bias, whole
    assert sd["base_optimizer_state"]["param_groups"][0]["lr"] == 1e-3
    with pytest.raises(NotYetSupportedError, match=r"optimizer\.load_state_dict.*engine\.load_checkpoint"):
        optimizer.load_state_dict({})
    engine.destroy()


def test_unknown_attributes_are_the_models(process_group: None) -> None:
    """As DeepSpeed's engine: what the engine lacks, the model answers (DeepSpeed-Chat calls
    ``model.gradient_checkpointing_enable()`` and reads ``model.model`` on the engine)."""

    class HFLike(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.Linear(4, 2)
            self.checkpointing = False

        def gradient_checkpointing_enable(self) -> None:
            self.checkpointing = True

    model = HFLike()
    engine, *_ = zeroshard.initialize(model=model, config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert engine.model is model.model
    engine.gradient_checkpointing_enable()
    assert model.checkpointing
    assert engine.config is not None and not isinstance(engine.config, torch.nn.Module)  # the engine's own wins
    with pytest.raises(AttributeError, match=r"neither the ZeroEngine nor its module \(HFLike\) has .* 'nope'"):
        _ = engine.nope
    assert not hasattr(engine, "__nope__")
    engine.destroy()


@pytest.mark.parametrize("enabled", [True, False])
def test_throughput_timer_counts_steps(enabled: bool, process_group: None) -> None:
    """``engine.tput_timer``, DeepSpeed's throughput timer (``timers.throughput``): DeepSpeed-Chat calls
    ``update_epoch_count()`` on it at each epoch's end."""
    model = torch.nn.Linear(4, 2)
    engine, *_ = zeroshard.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2, "timers": {"throughput": {
            "enabled": enabled}}, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}})
    timer = engine.tput_timer
    for _ in range(4 * 2):
        engine.backward(engine(torch.randn(3, 4)).square().mean())
        engine.step()
    assert (timer.global_step_count, timer.micro_step_count) == ((4, 8) if enabled else (0, 0))
    assert timer.batch_size == engine.train_batch_size() == 6
    assert (timer.avg_samples_per_sec() > 0) == enabled  # steps after the 2 warm-up ones were timed
    timer.update_epoch_count()
    assert (timer.epoch_count, timer.micro_step_count) == (1, 0)
    engine.destroy()


@pytest.mark.parametrize("stage", [0, 3])
def test_engine_without_optimizer_evaluates(stage: int, process_group: None) -> None:
    """transformers' ``Trainer.evaluate()`` before any training builds the engine with no optimizer
    (its config keeps the scheduler block): DeepSpeed evaluates with it; zeroshard refused it, and at
    ZeRO-3 left the model partitioned by the failed call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    x = torch.randn(4, 5)
    with torch.no_grad():
        want = model(x)
    with pytest.raises(ConfigError, match="does not belong to the model"):
        zeroshard.initialize(model=model, model_parameters=[torch.nn.Parameter(torch.zeros(2))], config={
            "train_batch_size": 2, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert all(p.numel() > 0 for p in model.parameters())  # nothing was partitioned by the failed call
    engine, optimizer, _, scheduler = zeroshard.initialize(model=model, config={
        "train_batch_size": 2, "zero_optimization": {"stage": stage},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}})
    assert scheduler is None and engine.lr_scheduler is None
    engine.eval()
    with torch.no_grad():
        torch.testing.assert_close(engine(x), want, rtol=0, atol=0)
    engine.train()
    engine.backward(engine(x).square().mean())
    with pytest.raises(ConfigError, match=r"engine\.step\(\): this engine was built without an optimizer"):
        engine.step()
    engine.destroy()
