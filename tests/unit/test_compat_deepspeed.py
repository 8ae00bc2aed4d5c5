"""The opt-in DeepSpeed compatibility layer (``zeroshard.compat.deepspeed``).

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

from zeroshard.compat import ds_misc, ds_ops
from zeroshard.compat.deepspeed import DISTRIBUTION_VERSION
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
        assert not [m for m in sys.modules if m.startswith("zeroshard.compat")], "core imports the layer"
        before = list(sys.meta_path)
        import zeroshard.compat.deepspeed as layer
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
        import zeroshard.compat.deepspeed as layer
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
        from zeroshard.engine import ZeroEngine
        from zeroshard.errors import NotYetSupportedError
        import zeroshard.compat.deepspeed as layer
        from zeroshard.compat.ds_surface import DeepSpeedModule
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
            import deepspeed.moe.layer
        except ModuleNotFoundError as exc:
            assert "zeroshard.compat.deepspeed" in str(exc) and exc.name == "deepspeed.moe", exc
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
        import zeroshard.compat.deepspeed as layer
        from zeroshard.compat.ds_surface import resolve
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
        import zeroshard.compat.deepspeed as layer
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
    proc = _run("", "-m", "zeroshard.compat.deepspeed", "--shadow", str(script), "--deepspeed", "ds.json")
    assert proc.stdout.split() == [DISTRIBUTION_VERSION, "['--deepspeed',", "'ds.json']"], proc.stdout
    refused = subprocess.run([sys.executable, "-m", "zeroshard.compat.deepspeed", str(script)],
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
    ours = ds_ops.DeepSpeedCPUAdam(source.param_groups, lr=1e-2, weight_decay=0.1, adamw_mode=adamw)
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
    opt = ds_ops.FusedAdam(p)
    assert opt.defaults["decoupled_weight_decay"] is True and opt.defaults["weight_decay"] == 0.0
    with pytest.raises(NotYetSupportedError, match="bias_correction"):
        ds_ops.FusedAdam(p, bias_correction=False)
    with pytest.raises(NotYetSupportedError, match="fp32_optimizer_states"):
        ds_ops.DeepSpeedCPUAdam(p, fp32_optimizer_states=False)
    with pytest.raises(ConfigError, match="amsgrad"):
        ds_ops.FusedAdam(p, amsgrad=True)


def test_clone_tensors_for_torch_save() -> None:
    base = torch.arange(6.0)
    state = {"a": base[:3], "b": [base[3:], (1, "x")], "c": None}
    out = ds_misc.clone_tensors_for_torch_save(state)
    assert out["a"].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert out["a"].tolist() == [0.0, 1.0, 2.0] and out["b"][0].tolist() == [3.0, 4.0, 5.0]
    assert out["b"][1] == (1, "x") and out["c"] is None and isinstance(out["b"][1], tuple)
