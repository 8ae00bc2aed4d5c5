"""The opt-in DeepSpeed compatibility layer (``zeroshard.deepspeed.imports``).

Everything that enables the layer runs in a subprocess, so its finder and ``deepspeed`` stand-ins
never leak into other tests. The real DeepSpeed is installed with the test extras: the refusal and
the restore are tested against it; transformers and accelerate are optional (skipped when absent).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from packaging.version import Version

import zeroshard
from zeroshard.deepspeed import misc, ops
from zeroshard.deepspeed.imports import DISTRIBUTION_VERSION
from zeroshard.errors import ConfigError, NotYetSupportedError

REPO = Path(__file__).resolve().parents[2]
SURFACE = REPO / "docs" / "hf_surface.json"
REAL_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_real = pytest.mark.skipif(not REAL_DEEPSPEED, reason="the real DeepSpeed is not installed")


def _run(code: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run Python code in a fresh interpreter; fail with its output when it exits non-zero."""
    proc = subprocess.run([sys.executable, *args] if not code else [sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def test_nothing_changes_without_enable() -> None:
    _run("""
        import importlib.metadata, importlib.util, sys
        import zeroshard, zeroshard.engine, zeroshard.initialize, zeroshard.zero
        zeroshard.initialize, zeroshard.runtime, zeroshard.utils
        layer_modules = ("zeroshard.deepspeed.imports", "zeroshard.deepspeed.surface")
        assert not [m for m in sys.modules if m.startswith(layer_modules)], "core imports the import layer"
        before = list(sys.meta_path)
        import zeroshard.deepspeed.imports as layer
        assert not layer.is_enabled() and sys.meta_path == before
        assert "deepspeed" not in sys.modules
        spec = importlib.util.find_spec("deepspeed")
        try:
            version = importlib.metadata.version("deepspeed")
        except importlib.metadata.PackageNotFoundError:
            version = None
        if spec is None:
            assert version is None
        else:  # the real one, untouched
            assert "zeroshard" not in spec.origin and "zeroshard" not in version, (spec, version)
        layer.disable()  # harmless when not enabled
        assert sys.meta_path == before
    """)


@needs_real
def test_refuses_to_hide_the_real_deepspeed() -> None:
    _run("""
        import importlib.util, sys
        from zeroshard.errors import ZeroshardError
        import zeroshard.deepspeed.imports as layer
        before = list(sys.meta_path)
        try:
            layer.enable()
        except layer.DeepSpeedShadowError as exc:
            assert isinstance(exc, ZeroshardError)
            message = str(exc)
        else:
            raise AssertionError("enable() hid the real DeepSpeed without shadow=True")
        assert "the real DeepSpeed is installed" in message and "enable(shadow=True)" in message, message
        assert importlib.util.find_spec("deepspeed").origin in message, message  # names where it is
        assert sys.meta_path == before and not layer.is_enabled() and "deepspeed" not in sys.modules
    """)


def test_shadow_resolves_to_zeroshard_and_disable_restores() -> None:
    proc = _run("""
        import importlib.metadata, importlib.util, sys
        import zeroshard, zeroshard.zero
        from zeroshard.deepspeed.engine import ZeroEngine
        from zeroshard.errors import NotYetSupportedError
        import zeroshard.deepspeed.imports as layer
        from zeroshard.deepspeed.surface import DeepSpeedModule
        before = list(sys.meta_path)
        layer.enable(shadow=True)
        layer.enable(shadow=True)  # idempotent
        assert sys.meta_path[1:] == before

        import deepspeed
        assert isinstance(deepspeed, DeepSpeedModule)
        assert deepspeed.initialize is zeroshard.initialize
        assert deepspeed.zero.Init is zeroshard.zero.Init
        assert deepspeed.zero.GatheredParameters is zeroshard.zero.GatheredParameters
        assert deepspeed.__version__ == layer.DISTRIBUTION_VERSION
        assert deepspeed.__file__ == layer.__file__ and deepspeed.comm.__file__ == layer.__file__  # was AttributeError
        spec = importlib.util.find_spec("deepspeed")
        assert spec is not None and spec.loader is layer._DeepSpeedFinder.loader
        assert importlib.metadata.version("deepspeed") == layer.DISTRIBUTION_VERSION
        assert importlib.metadata.metadata("deepspeed")["Name"] == "deepspeed"
        from deepspeed import DeepSpeedEngine
        from deepspeed.runtime.engine import DeepSpeedEngine as Engine2
        assert DeepSpeedEngine is ZeroEngine and Engine2 is ZeroEngine
        import deepspeed.runtime.zero.stage3 as s3
        estimator = "estimate_zero3_model_states_mem_needs_all_live"
        assert getattr(s3, estimator) is getattr(zeroshard, estimator)
        assert "WarmupLR" in deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES

        # a name Hugging Face imports that zeroshard lacks: importable, any use is a clear error
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        assert not isinstance(object(), UlyssesSPAttentionHF)
        for use in (lambda: UlyssesSPAttentionHF(), lambda: UlyssesSPAttentionHF.register_with_transformers):
            try:
                use()
            except NotYetSupportedError as exc:
                assert "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF" in str(exc), exc
            else:
                raise AssertionError("a placeholder did not raise")
        # names and modules nobody listed stay absent, as in a real package
        assert not hasattr(deepspeed.comm, "no_such_function")
        try:
            import deepspeed.inference.engine
        except ModuleNotFoundError as exc:
            assert "zeroshard.deepspeed.imports" in str(exc) and exc.name == "deepspeed.inference", exc
        else:
            raise AssertionError("an unknown deepspeed module imported")

        layer.disable()
        assert sys.meta_path == before and not layer.is_enabled()
        assert not [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]
        assert zeroshard.zero.__spec__.name == "zeroshard.zero"  # stand-ins never rename zeroshard's modules
        real = importlib.util.find_spec("deepspeed")
        if real is not None:
            assert importlib.metadata.version("deepspeed") == "0.19.8"
            import deepspeed
            assert not isinstance(deepspeed, DeepSpeedModule) and deepspeed.__file__ == real.origin
            try:  # already imported: nothing can be redirected any more
                layer.enable(shadow=True)
            except layer.DeepSpeedShadowError as exc:
                assert "already imported" in str(exc), exc
            else:
                raise AssertionError("enable() after importing the real DeepSpeed")
            print("restored the real DeepSpeed")
    """)
    assert REAL_DEEPSPEED == ("restored the real DeepSpeed" in proc.stdout)


def test_every_probed_name_resolves() -> None:
    """Each name that transformers/accelerate import or read (docs/hf_surface.json) resolves: an
    object, or a placeholder whose use raises NotYetSupportedError; never an ImportError."""
    _run(f"""
        import json
        import zeroshard.deepspeed.imports as layer
        from zeroshard.deepspeed.surface import resolve
        from zeroshard.errors import NotYetSupportedError
        layer.enable(shadow=True)
        rows = json.load(open({str(SURFACE)!r}))["uses"]
        names = [r["name"] for r in rows if r["kind"] in ("import", "attribute")]
        assert len(names) > 20, names
        for name in names:
            try:
                resolve(name)
            except NotYetSupportedError:
                pass  # an attribute of a placeholder (``deepspeed.utils.groups._get_...``)
    """)


def test_version_passes_the_gates() -> None:
    rows = json.loads(SURFACE.read_text())["uses"]
    gates = [r["name"].split()[1:] for r in rows if r["name"].startswith("compare_versions")]
    assert len(gates) >= 8
    ours = Version(DISTRIBUTION_VERSION)
    assert ours.public == "0.19.8" and ours.local is not None and ours.local.startswith("zeroshard")
    for op, wanted in gates:
        if op.startswith(">"):
            assert ours >= Version(wanted), (op, wanted)  # a minimum accelerate requires
        else:
            assert not ours < Version(wanted), (op, wanted)  # a branch for old DeepSpeeds
    assert ours >= Version("0.9.3")  # transformers' dependency table: deepspeed>=0.9.3


HAS_HF = importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("accelerate") is not None


@pytest.mark.skipif(not HAS_HF, reason="transformers and accelerate are not installed")
def test_transformers_and_accelerate_see_deepspeed() -> None:
    _run("""
        import warnings
        import zeroshard.deepspeed.imports as layer
        layer.enable(shadow=True)
        from transformers.integrations import is_deepspeed_available, deepspeed as hf_ds
        from accelerate.utils import is_deepspeed_available as acc_available, HfDeepSpeedConfig as AccConfig
        assert is_deepspeed_available() and acc_available()
        # the import-time gate saw DeepSpeed: transformers' config class is built on accelerate's
        assert issubclass(hf_ds.HfDeepSpeedConfig, AccConfig)
        keep = hf_ds.HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
        assert hf_ds.is_deepspeed_zero3_enabled()
        import deepspeed
        assert deepspeed.zero.Init is __import__("zeroshard").zero.Init
        layer.disable()
        with warnings.catch_warnings(record=True) as caught:  # too late for modules already imported
            warnings.simplefilter("always")
            layer.enable(shadow=True)
        assert any("accelerate.utils" in str(w.message) for w in caught), [str(w.message) for w in caught]
    """, timeout=400)


@needs_real
def test_runner_enables_the_layer_for_a_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import sys, deepspeed\nprint(deepspeed.__version__, sys.argv[1:])\n")
    proc = _run("", "-m", "zeroshard.deepspeed.imports", "--shadow", str(script), "--deepspeed", "ds.json")
    assert proc.stdout.split() == [DISTRIBUTION_VERSION, "['--deepspeed',", "'ds.json']"], proc.stdout
    refused = subprocess.run([sys.executable, "-m", "zeroshard.deepspeed.imports", str(script)],
                             capture_output=True, text=True, timeout=240, cwd=REPO)
    assert refused.returncode != 0 and "DeepSpeedShadowError" in refused.stderr, refused.stderr


# In-process: these modules have no import side effects (test_nothing_changes_without_enable).

def _adam_reference(decoupled: bool, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls(params, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, fused=True)


@pytest.mark.parametrize("adamw", [True, False])
def test_cpu_adam_matches_torch(adamw: bool) -> None:
    """DeepSpeedCPUAdam built as accelerate builds it (from a torch AdamW's param groups) steps as
    torch's Adam/AdamW: the mode is the constructor's, not the groups'."""
    torch.manual_seed(0)
    ours_p = [torch.randn(7, 3, requires_grad=True), torch.randn(5, requires_grad=True)]
    ref_p = [p.detach().clone().requires_grad_() for p in ours_p]
    source = torch.optim.AdamW(ours_p, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    ours = ops.DeepSpeedCPUAdam(source.param_groups, lr=1e-2, weight_decay=0.1, adamw_mode=adamw)
    ref = _adam_reference(adamw, ref_p)
    for step in range(3):
        for params, opt in ((ours_p, ours), (ref_p, ref)):
            opt.zero_grad()
            sum(((p * (step + 1)) ** 2).sum() for p in params).backward()
            opt.step()
    for a, b in zip(ours_p, ref_p, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fused_adam_defaults_and_refusals() -> None:
    p = [torch.zeros(3, requires_grad=True)]
    opt = ops.FusedAdam(p)
    assert opt.defaults["decoupled_weight_decay"] is True and opt.defaults["weight_decay"] == 0.0
    with pytest.raises(NotYetSupportedError, match="bias_correction"):
        ops.FusedAdam(p, bias_correction=False)
    with pytest.raises(NotYetSupportedError, match="fp32_optimizer_states"):
        ops.DeepSpeedCPUAdam(p, fp32_optimizer_states=False)
    with pytest.raises(ConfigError, match="amsgrad"):
        ops.FusedAdam(p, amsgrad=True)


def test_clone_tensors_for_torch_save() -> None:
    base = torch.arange(6.0)
    state = {"a": base[:3], "b": [base[3:], (1, "x")], "c": None}
    out = misc.clone_tensors_for_torch_save(state)
    assert out["a"].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert out["a"].tolist() == [0.0, 1.0, 2.0] and out["b"][0].tolist() == [3.0, 4.0, 5.0]
    assert out["b"][1] == (1, "x") and out["c"] is None and isinstance(out["b"][1], tuple)


def test_names_deepspeed_examples_import_under_the_shadow() -> None:
    """What DeepSpeedExamples' cifar10_deepspeed.py and DeepSpeed-Chat (step 1 and dschat/utils) import
    resolves to zeroshard's objects, and cifar10's dense path with --moe-param-group trains."""
    _run("""
        import zeroshard.deepspeed.imports as layer
        layer.enable(shadow=True)
        import torch
        import zeroshard, zeroshard.deepspeed.accelerator, zeroshard.deepspeed.utils.zero_to_fp32 as z2f
        from zeroshard.deepspeed import misc
        from zeroshard.deepspeed import timers as ds_timer
        from zeroshard.errors import NotYetSupportedError
        from zeroshard.zero.param_status import ZeroParamStatus as Ours

        import deepspeed
        from deepspeed import get_accelerator  # DeepSpeed-Chat's main.py
        assert get_accelerator is zeroshard.accelerator.get_accelerator is zeroshard.get_accelerator
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # dschat/utils/utils.py
        assert ZeroParamStatus is Ours
        # dschat/utils/module/lora.py reads it through the attribute path
        assert deepspeed.runtime.zero.partition_parameters.ZeroParamStatus.NOT_AVAILABLE is Ours.NOT_AVAILABLE
        from deepspeed.compression.helper import recursive_getattr, recursive_setattr
        from deepspeed.utils.module_utils import recursive_getattr as getattr2
        assert recursive_getattr is getattr2 is misc.recursive_getattr
        assert recursive_setattr is misc.recursive_setattr
        from deepspeed.runtime.utils import see_memory_usage
        assert see_memory_usage is misc.see_memory_usage
        from deepspeed.utils.timer import SynchronizedWallClockTimer, ThroughputTimer
        assert SynchronizedWallClockTimer is ds_timer.SynchronizedWallClockTimer
        assert ThroughputTimer is ds_timer.ThroughputTimer
        from deepspeed.utils.zero_to_fp32 import (
            convert_zero_checkpoint_to_fp32_state_dict, get_fp32_state_dict_from_zero_checkpoint)
        assert get_fp32_state_dict_from_zero_checkpoint is z2f.get_fp32_state_dict_from_zero_checkpoint
        assert convert_zero_checkpoint_to_fp32_state_dict is z2f.convert_zero_checkpoint_to_fp32_state_dict

        # cifar10_deepspeed.py: imported at top level, whatever the flags
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
        try:  # --moe: deepspeed.moe.layer.MoE(...)
            deepspeed.moe.layer.MoE(hidden_size=4, expert=torch.nn.Linear(4, 4), num_experts=2)
        except NotYetSupportedError as exc:
            assert "deepspeed.moe.layer.MoE" in str(exc) and "Mixture of Experts" in str(exc), exc
        else:
            raise AssertionError("MoE was built")
        # --moe-param-group with a dense model: create_moe_param_groups, then initialize
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": [p for p in net.parameters()], "name": "parameters"})
        assert len(groups) == 1 and groups[0]["params"] == list(net.parameters()), groups
        engine, optimizer, _, _ = deepspeed.initialize(model=net, model_parameters=groups, config={
            "train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}})
        before = [p.detach().clone() for p in net.parameters()]
        loss = engine(torch.randn(4, 4)).square().mean()
        engine.backward(loss)
        engine.step()
        assert all(not torch.equal(a, p) for a, p in zip(before, net.parameters())), "no step"
        engine.destroy()
    """)


def test_zero_param_status_is_deepspeeds() -> None:
    from zeroshard.zero.param_status import ZeroParamStatus

    ours = {m.name: m.value for m in ZeroParamStatus}
    assert ours == {"AVAILABLE": 1, "NOT_AVAILABLE": 2, "INFLIGHT": 3}
    if REAL_DEEPSPEED:  # against DeepSpeed's source, without importing it
        import ast

        spec = importlib.util.find_spec("deepspeed")
        assert spec is not None and spec.submodule_search_locations
        source = Path(spec.submodule_search_locations[0], "runtime", "zero", "partition_parameters.py").read_text()
        cls = next(n for n in ast.walk(ast.parse(source))
                   if isinstance(n, ast.ClassDef) and n.name == "ZeroParamStatus")
        theirs = {a.targets[0].id: ast.literal_eval(a.value) for a in cls.body if isinstance(a, ast.Assign)}
        assert ours == theirs


def test_get_accelerator_at_top_level() -> None:
    assert zeroshard.get_accelerator is zeroshard.accelerator.get_accelerator
    assert "get_accelerator" in zeroshard.__all__ and "moe" in zeroshard.__all__


def test_recursive_getattr_and_setattr() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sequential(torch.nn.Linear(3, 3)))
    assert misc.recursive_getattr(model, "1.0") is model[1][0]
    assert misc.recursive_getattr(model, "1.0.weight") is model[1][0].weight
    replacement = torch.nn.Linear(3, 3, bias=False)
    misc.recursive_setattr(model, "1.0", replacement)  # DeepSpeed-Chat's LoRA swap
    assert model[1][0] is replacement and dict(model.named_modules())["1.0"] is replacement
    misc.recursive_setattr(model, "extra", torch.nn.ReLU())  # a single name: on the model itself
    assert isinstance(model.extra, torch.nn.ReLU)
    with pytest.raises(AttributeError):
        misc.recursive_getattr(model, "1.nope")


def test_see_memory_usage(capsys: pytest.CaptureFixture[str]) -> None:
    misc.see_memory_usage("quiet")  # force=False: nothing, as DeepSpeed
    assert capsys.readouterr().out == ""
    misc.see_memory_usage("after init", force=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "after init" and lines[1].startswith("MA ") and "Max_CA" in lines[1], lines
    assert lines[2].startswith("CPU Virtual Memory:  used = ") and "percent" in lines[2], lines


def test_timers(capsys: pytest.CaptureFixture[str]) -> None:
    import time
    from types import SimpleNamespace

    from zeroshard.deepspeed.timers import SynchronizedWallClockTimer, ThroughputTimer

    timers = SynchronizedWallClockTimer()
    timers("fwd").start()
    time.sleep(0.02)
    timers("fwd").stop()
    with pytest.raises(RuntimeError, match="not started"):
        timers("fwd").stop()
    assert timers.get_timers().keys() == {"fwd"} and timers("fwd").elapsed(reset=False) >= 15
    timers.log(["fwd", "absent"], normalizer=2)
    out = capsys.readouterr().out
    assert out.startswith("time (ms) | fwd: ") and "absent" not in out and 7.5 <= float(out.split()[-1]) < 1000, out
    assert timers("fwd").elapsed() == 0  # log reset it
    assert "mem_allocated" in timers.memory_usage()

    lines: list[str] = []
    tput = ThroughputTimer(SimpleNamespace(enabled=True, synchronized=True), batch_size=4, start_step=1,
                           steps_per_output=2, logging_fn=lines.append)
    for _ in range(3):
        tput.start()
        time.sleep(0.005)
        tput.stop(global_step=True)
    tput.update_epoch_count()
    assert (tput.global_step_count, tput.epoch_count, tput.micro_step_count) == (3, 1, 0)
    assert 0 < tput.avg_samples_per_sec() < 4 / 0.004  # two timed steps of >= 5 ms each
    assert len(lines) == 1 and "global_step=2, RunningAvgSamplesPerSec=" in lines[0], lines


def test_moe_names_without_the_layer() -> None:
    """``import zeroshard as deepspeed``: ``deepspeed.moe`` imports, building an expert layer is a clear
    error, and the parameter helpers answer for a dense model."""
    import zeroshard as deepspeed

    with pytest.raises(NotYetSupportedError, match=r"deepspeed\.moe\.layer\.MoE.*Mixture of Experts"):
        deepspeed.moe.layer.MoE(hidden_size=4, expert=torch.nn.Linear(4, 4))
    utils = deepspeed.moe.utils
    model = torch.nn.Linear(2, 2)
    params = list(model.parameters())
    assert not isinstance(model, deepspeed.moe.layer.MoE) and utils.has_moe_layers(model) == (False, 0)
    assert not any(utils.is_moe_param(p) for p in params)
    assert utils.split_params_into_shared_and_expert_params(params) == (params, [])
    groups = ({"params": iter(params), "name": "a", "lr": 0.1},)
    out = utils.split_params_into_different_moe_groups_for_optimizer(groups)
    assert out == [{"params": params, "name": "a", "lr": 0.1}] and not utils.is_moe_param_group(out[0])
    assert utils.configure_moe_param_groups(params) == [{"params": params, "name": "dense-params"}]
    with pytest.raises(ValueError, match="Unknown param group type"):
        utils.split_params_into_different_moe_groups_for_optimizer(params[0])
    expert = torch.nn.Parameter(torch.zeros(2))
    expert.allreduce = False  # type: ignore[attr-defined]  # DeepSpeed's mark of an expert parameter
    with pytest.raises(NotYetSupportedError, match="expert parameter"):
        utils.split_params_into_different_moe_groups_for_optimizer({"params": [expert], "name": "e"})


def test_pipe_names_import_and_refuse() -> None:
    """DeepSpeedExamples' pipeline script imports ``deepspeed.pipe`` at top level: the names import
    (its ``-p 0`` data-parallel mode runs), building a pipeline is an error naming the feature."""
    import zeroshard as deepspeed

    with pytest.raises(NotYetSupportedError, match=r"deepspeed\.pipe\.PipelineModule.*pipeline parallelism"):
        deepspeed.pipe.PipelineModule(layers=[torch.nn.Linear(2, 2)], num_stages=2)
    with pytest.raises(NotYetSupportedError, match=r"deepspeed\.pipe\.TiedLayerSpec"):
        deepspeed.pipe.TiedLayerSpec("embed", torch.nn.Embedding, 4, 2)
    assert not isinstance(torch.nn.Linear(2, 2), deepspeed.pipe.PipelineModule)


def test_pipe_dataloader_and_seed_names_under_the_shadow() -> None:
    """DeepSpeedExamples' pipeline_parallelism/train.py imports these at top level."""
    _run("""
        import zeroshard.deepspeed.imports as layer
        layer.enable(shadow=True)
        import zeroshard.deepspeed.utils
        from zeroshard.deepspeed import misc, pipe
        from deepspeed.pipe import PipelineModule
        from deepspeed.utils import RepeatingLoader
        from deepspeed.runtime.dataloader import RepeatingLoader as Loader2
        from deepspeed.runtime.utils import set_random_seed
        assert PipelineModule is pipe.PipelineModule and set_random_seed is misc.set_random_seed
        assert RepeatingLoader is Loader2 is zeroshard.utils.RepeatingLoader
    """)


def test_repeating_loader_and_set_random_seed() -> None:
    from zeroshard.deepspeed.misc import set_random_seed
    from zeroshard.deepspeed.utils import RepeatingLoader

    loader = RepeatingLoader([1, 2, 3])
    assert [next(loader) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    assert iter(loader) is loader
    set_random_seed(7)
    a = (torch.rand(2), __import__("random").random())
    set_random_seed(7)
    assert torch.equal(a[0], torch.rand(2)) and a[1] == __import__("random").random()


def test_base_optimizer_names_are_zeroshards_optimizer() -> None:
    """Lightning Fabric's DeepSpeed ``load_checkpoint`` imports ``deepspeed.runtime.base_optimizer`` and
    restores the optimizer state only if an object in the state is a ``DeepSpeedOptimizer``: the module
    was missing (ModuleNotFoundError)."""
    _run("""
        import zeroshard.deepspeed.imports as layer
        layer.enable(shadow=True)
        from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer
        from zeroshard.core.zero3.stage3 import Stage3Optimizer
        from zeroshard.core.zero_optimizer import ZeroOptimizer
        assert issubclass(Stage3Optimizer, DeepSpeedOptimizer) and issubclass(ZeroOptimizer, ZeROOptimizer)
    """)
