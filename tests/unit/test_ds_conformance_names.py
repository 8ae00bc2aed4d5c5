"""DeepSpeed names that DeepSpeed's own unit tests import, and what they do (docs/deepspeed_internals.md).

The names themselves are checked in this process; the layer (``import deepspeed`` resolving to
zeroshard) in subprocesses, so that its finder never leaks into other tests.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.deepspeed import op_builder, version_info
from zeroshard.deepspeed.accelerator import is_current_accelerator_supported
from zeroshard.deepspeed.misc import OffloadDeviceEnum, get_model_ckpt_name_for_rank, required_torch_version
from zeroshard.deepspeed.runtime.zero.stage3 import unwrap_model_for_generation
from zeroshard.deepspeed.runtime.zero.tiling import TiledLinear, TiledLinearReturnBias, partition_uniform
from zeroshard.deepspeed.runtime.zero.utils import ZeRORuntimeException
from zeroshard.deepspeed.utils import (
    safe_get_full_grad,
    safe_update_full_grad_vectorized,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    z3_leaf_module,
)
from zeroshard.errors import NotYetSupportedError, ZeroshardError
from zeroshard.zero.param_status import ZeroParamStatus

REPO = Path(__file__).resolve().parents[2]
REAL_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _run(code: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


# -- accelerator, versions, op builders ----------------------------------------------------------------
def test_current_accelerator_is_supported() -> None:
    assert is_current_accelerator_supported() is True
    assert zeroshard.get_accelerator().device_name() in ("cpu", "cuda")


def test_git_version_info_describes_the_installed_torch() -> None:
    info = version_info.torch_info
    assert set(info) == {"version", "bf16_support", "cuda_version", "nccl_version", "hip_version"}
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    assert info["version"] == f"{major}.{minor}"
    cuda = torch.version.cuda
    assert info["cuda_version"] == (".".join(cuda.split(".")[:2]) if cuda else "0.0")
    if not torch.cuda.is_available():
        assert info["nccl_version"] == "0.0" and info["bf16_support"] is False
    for key in ("version", "cuda_version", "nccl_version", "hip_version"):  # readers take int(major), int(minor)
        assert len([int(p) for p in str(info[key]).split(".")]) == 2, info
    assert version_info.version.startswith("0.19.8+zeroshard")
    assert version_info.accelerator_name == zeroshard.get_accelerator().device_name()
    assert version_info.installed_ops and not any(version_info.installed_ops.values())
    assert version_info.git_hash == version_info.git_branch == "unknown"


def test_op_builders_say_what_zeroshard_provides() -> None:
    expected = {"CPUAdamBuilder": ("cpu_adam", True), "CPUAdagradBuilder": ("cpu_adagrad", True),
                "CPULionBuilder": ("cpu_lion", True), "FusedAdamBuilder": ("fused_adam", True),
                "AsyncIOBuilder": ("async_io", True), "FusedLambBuilder": ("fused_lamb", False),
                "QuantizerBuilder": ("quantizer", False), "TransformerBuilder": ("transformer", False)}
    for cls_name, (name, provided) in expected.items():
        cls = op_builder.BUILDERS[cls_name]
        assert cls.NAME == name and cls().name == name
        assert cls().is_compatible() is provided and cls().is_compatible(verbose=True) is provided
        assert op_builder.COMPATIBLE_OPS[name] is provided
    assert op_builder.COMPATIBLE_OPS["deepspeed_not_implemented"] is False
    assert set(op_builder.COMPATIBLE_OPS) == {c.NAME for c in op_builder.BUILDERS.values()}


@pytest.mark.parametrize("cls_name", ["CPUAdamBuilder", "FusedLambBuilder"])
def test_op_builder_load_says_no_compiled_ops(cls_name: str) -> None:
    builder = op_builder.BUILDERS[cls_name]()
    for load in (builder.load, builder.jit_load):
        with pytest.raises(NotYetSupportedError, match="zeroshard builds no compiled ops"):
            load()


@pytest.mark.skipif(not REAL_DEEPSPEED, reason="the real DeepSpeed is not installed")
def test_op_builder_names_are_deepspeeds() -> None:
    """Each builder's NAME is the one of DeepSpeed's builder class of that name (its generic builders,
    and the CPU ones for the CPU communication ops)."""
    out = _run("""
        import importlib, inspect, json, pkgutil
        import deepspeed.ops.op_builder as ob
        names = {}
        for package in ("deepspeed.ops.op_builder", "deepspeed.ops.op_builder.cpu"):
            pkg = importlib.import_module(package)
            for info in pkgutil.iter_modules(pkg.__path__):
                if info.ispkg or info.name in ("all_ops", "builder"):
                    continue
                module = importlib.import_module(f"{package}.{info.name}")
                for name, obj in vars(module).items():
                    if inspect.isclass(obj) and name.endswith("Builder") and getattr(obj, "NAME", None):
                        names.setdefault(name, obj.NAME)
        print(json.dumps(names))
    """, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    real = json.loads(out.strip().splitlines()[-1])
    ours = {name: cls.NAME for name, cls in op_builder.BUILDERS.items()}
    common = set(real) & set(ours)
    assert len(common) >= 20, sorted(common)
    assert {n: ours[n] for n in common} == {n: real[n] for n in common}


def test_required_torch_version() -> None:
    assert required_torch_version(min_version=1.4) and required_torch_version(min_version="2.0")
    assert not required_torch_version(max_version=2.0)
    assert not required_torch_version(min_version=99)
    installed = torch.__version__.split("+")[0]
    assert required_torch_version(min_version=installed, max_version=installed + ".post1") is True
    with pytest.raises(AssertionError, match="min_version or max_version"):
        required_torch_version()


# -- leaf modules -----------------------------------------------------------------------------------------
class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(2, 2)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(2)])


def test_leaf_modules_by_name() -> None:
    model = _Model()
    matched, missing = set_z3_leaf_modules_by_name(model, ["child", "layers.1"])
    assert matched == [model.child, model.layers[1]] and missing == []
    assert z3_leaf_module(model.child) and z3_leaf_module(model.layers[1]) and not z3_leaf_module(model.layers[0])
    matched, missing = set_z3_leaf_modules_by_name(model, ["child", "nope"], flag=False, raise_if_not_found=False)
    assert matched == [model.child] and missing == ["nope"] and not z3_leaf_module(model.child)
    with pytest.raises(ValueError, match="nope"):
        set_z3_leaf_modules_by_name(model, ["nope"])


def test_leaf_modules_by_suffix() -> None:
    model = _Model()
    matched, missing = set_z3_leaf_modules_by_suffix(model, [".0", "layers.0"])
    # "layers.0", "layers.0.0" and "layers.1.0" end with ".0"; layers.0 is listed once
    assert matched == [model.layers[0], model.layers[0][0], model.layers[1][0]] and missing == []
    assert all(z3_leaf_module(m) for m in matched) and not z3_leaf_module(model.layers[1])
    matched, missing = set_z3_leaf_modules_by_suffix(model, ["zzz"], raise_if_not_found=False)
    assert matched == [] and missing == ["zzz"]
    with pytest.raises(ValueError, match="zzz"):
        set_z3_leaf_modules_by_suffix(model, ["zzz"])


# -- tiling -------------------------------------------------------------------------------------------------
def test_partition_uniform_puts_the_remainder_first() -> None:
    assert partition_uniform(10, 3) == [0, 4, 7, 10]
    assert partition_uniform(40, 32)[:10] == [0, 2, 4, 6, 8, 10, 12, 14, 16, 17]
    assert partition_uniform(3, 3) == [0, 1, 2, 3] and partition_uniform(5, 1) == [0, 5]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("in_f", "out_f", "in_splits", "out_splits"), [(32, 40, 5, 5), (23, 29, 2, 3), (7, 5, 1, 1)])
def test_tiled_linear_is_the_linear_it_copies(bias: bool, in_f: int, out_f: int, in_splits: int,
                                              out_splits: int) -> None:
    torch.manual_seed(0)
    base = nn.Linear(in_f, out_f, bias=bias)
    tiled = TiledLinear(in_f, out_f, bias=bias, in_splits=in_splits, out_splits=out_splits,
                        init_linear=copy.deepcopy(base))
    for o in range(out_splits):
        for i in range(in_splits):
            tile = tiled.linears[o][i]
            rows = slice(tiled.out_parts[o], tiled.out_parts[o + 1])
            cols = slice(tiled.in_parts[i], tiled.in_parts[i + 1])
            assert torch.equal(tile.weight, base.weight[rows, cols])
            assert (tile.bias is not None) == (bias and i == in_splits - 1)
    x = torch.randn(3, in_f)
    torch.testing.assert_close(tiled(x), base(x))
    base(x).square().sum().backward()
    tiled(x).square().sum().backward()
    for o in range(out_splits):
        for i in range(in_splits):
            rows = slice(tiled.out_parts[o], tiled.out_parts[o + 1])
            cols = slice(tiled.in_parts[i], tiled.in_parts[i + 1])
            torch.testing.assert_close(tiled.linears[o][i].weight.grad, base.weight.grad[rows, cols])
    assert sum(p.numel() for p in tiled.parameters()) == sum(p.numel() for p in base.parameters())


def test_tiled_linear_refuses_bad_splits_and_can_keep_outputs_apart() -> None:
    for splits in (0, 33):
        with pytest.raises(RuntimeError):
            TiledLinear(32, 32, in_splits=splits, out_splits=1)
        with pytest.raises(RuntimeError):
            TiledLinear(32, 32, in_splits=1, out_splits=splits)
    tiled = TiledLinear(4, 6, in_splits=2, out_splits=3, combine_out_splits=False, input_is_already_split=True)
    x = torch.randn(2, 4)
    outs = tiled(list(x.split([2, 2], dim=-1)))
    assert [o.shape for o in outs] == [torch.Size([2, 2])] * 3
    with pytest.raises(ValueError, match="bias"):
        TiledLinear(4, 6, bias=False, init_linear=nn.Linear(4, 6))


class _ReturnsBias(nn.Linear):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # type: ignore[override]
        return nn.functional.linear(x, self.weight), self.bias


@pytest.mark.parametrize("bias", [True, False])
def test_tiled_linear_return_bias(bias: bool) -> None:
    torch.manual_seed(0)
    base = _ReturnsBias(9, 7, bias=bias)
    tiled = TiledLinearReturnBias(9, 7, bias=bias, in_splits=2, out_splits=2, linear_cls=_ReturnsBias,
                                  init_linear=copy.deepcopy(base))
    x = torch.randn(4, 9)
    (out, out_bias), (ref, ref_bias) = tiled(x), base(x)
    torch.testing.assert_close(out, ref)
    if bias:
        torch.testing.assert_close(out_bias, ref_bias)
    else:
        assert out_bias is None


# -- engine-level names --------------------------------------------------------------------------------------
def _engine(stage: int) -> zeroshard.ZeroEngine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    engine, *_ = zeroshard.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage,
                                                                   "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    return engine


def test_safe_update_full_grad_vectorized(process_group: None) -> None:
    engine = _engine(2)
    x = torch.randn(2, 8)
    engine.backward(engine(x).square().sum())
    params = list(engine.module.parameters())
    before = [safe_get_full_grad(p).clone() for p in params]
    safe_update_full_grad_vectorized(params, lambda grad, param: grad * 2 + 1)
    for p, old in zip(params, before, strict=True):
        torch.testing.assert_close(safe_get_full_grad(p), old * 2 + 1)
    loose = nn.Parameter(torch.ones(3))  # not trained by the engine: its .grad is updated in place
    loose.grad = torch.ones(3)
    safe_update_full_grad_vectorized([loose], lambda grad, param: grad * 5)
    assert torch.equal(loose.grad, torch.full((3,), 5.0))
    engine.step()
    engine.destroy()


def test_unwrap_model_for_generation_at_zero3(process_group: None) -> None:
    engine = _engine(3)
    offload = engine.optimizer.parameter_offload
    weight = engine.module[0].weight
    x = torch.randn(2, 8)
    assert offload.forward_hooks and weight.ds_status == ZeroParamStatus.NOT_AVAILABLE
    with unwrap_model_for_generation(engine) as unwrapped:
        assert unwrapped is engine and offload.forward_hooks == [] and offload.backward_hooks == []
        assert weight.ds_status == ZeroParamStatus.AVAILABLE and weight.shape == (8, 8)
        with torch.no_grad():
            generated = [engine.module(x) for _ in range(3)]
    assert offload.forward_hooks and weight.ds_status == ZeroParamStatus.NOT_AVAILABLE
    with torch.no_grad():
        expected = engine(x)  # through the hooks again
    for out in generated:
        torch.testing.assert_close(out, expected)
    engine.backward(engine(x).square().sum())  # and trains afterwards
    engine.step()
    engine.destroy()


def test_unwrap_model_for_generation_below_zero3_just_runs(process_group: None) -> None:
    engine = _engine(1)
    with unwrap_model_for_generation(engine) as unwrapped:
        assert unwrapped is engine
    engine.destroy()


def test_small_names() -> None:
    assert issubclass(ZeRORuntimeException, ZeroshardError)
    assert OffloadDeviceEnum.cpu == "cpu" and {"device": OffloadDeviceEnum.nvme}["device"] == "nvme"
    assert get_model_ckpt_name_for_rank("ck/global_step0", "00") == "ck/global_step0/mp_rank_00_model_states.pt"


# -- through the layer ------------------------------------------------------------------------------------------
def test_layer_presents_the_names() -> None:
    _run("""
        import sys, types
        import zeroshard.deepspeed.imports as layer
        layer.enable(shadow=True)
        import deepspeed, deepspeed.ops, deepspeed.utils
        import torch
        from deepspeed.accelerator import get_accelerator, is_current_accelerator_supported
        from deepspeed.git_version_info import torch_info
        from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder, FusedLambBuilder
        from deepspeed.ops.aio import AsyncIOBuilder
        from deepspeed.utils.torch import required_torch_version
        from deepspeed.utils.z3_leaf_module import set_z3_leaf_modules as by_module
        from deepspeed.utils import (set_z3_leaf_modules, z3_leaf_module, set_z3_leaf_modules_by_name,
                                     set_z3_leaf_modules_by_suffix, safe_update_full_grad_vectorized)
        from deepspeed.runtime.zero import unwrap_model_for_generation, ZeroParamStatus
        from deepspeed.runtime.zero.tiling import TiledLinear, TiledLinearReturnBias
        from deepspeed.runtime.zero.utils import ZeRORuntimeException
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
        from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES
        from zeroshard.errors import ConfigError, NotYetSupportedError
        import zeroshard.deepspeed.runtime.zero.tiling as tiling, zeroshard.core.zero3.units as units

        assert is_current_accelerator_supported() is True
        assert torch_info["version"] == ".".join(torch.__version__.split("+")[0].split(".")[:2])
        assert deepspeed.git_version_info.installed_ops["cpu_adam"] is False

        ops = deepspeed.ops.__compatible_ops__
        assert ops is deepspeed.ops.__compatible_ops__  # one dict
        assert ops[CPUAdamBuilder.NAME] and ops[FusedAdamBuilder.NAME] and ops[AsyncIOBuilder.NAME]
        assert ops[FusedLambBuilder.NAME] is False and CPUAdamBuilder().is_compatible()
        assert deepspeed.ops.aio.AsyncIOBuilder is deepspeed.ops.op_builder.AsyncIOBuilder
        try:
            deepspeed.ops.__not_a_name__
        except AttributeError:
            pass
        else:
            raise AssertionError("an unknown dunder resolved")
        try:
            CPUAdamBuilder().load()
        except NotYetSupportedError as exc:
            assert "builds no compiled ops" in str(exc)
        else:
            raise AssertionError("load() returned")

        assert required_torch_version(min_version=1.4)

        # the function, also after the submodule was imported; the submodule still imports from
        import deepspeed.utils.z3_leaf_module
        assert deepspeed.utils.z3_leaf_module is units.z3_leaf_module is z3_leaf_module
        assert isinstance(sys.modules["deepspeed.utils.z3_leaf_module"], types.ModuleType)
        assert by_module is set_z3_leaf_modules is units.set_z3_leaf_modules
        m = torch.nn.Sequential(torch.nn.Linear(2, 2))
        assert set_z3_leaf_modules_by_name(m, ["0"]) == ([m[0]], []) and deepspeed.utils.z3_leaf_module(m[0])
        assert set_z3_leaf_modules_by_suffix(m, ["0"], flag=False) == ([m[0]], []) and not z3_leaf_module(m[0])

        assert deepspeed.zero.TiledLinear is TiledLinear is tiling.TiledLinear
        assert deepspeed.runtime.zero.TiledLinearReturnBias is TiledLinearReturnBias
        assert deepspeed.zero.unwrap_model_for_generation is unwrap_model_for_generation
        assert deepspeed.runtime.zero.utils.ZeRORuntimeException is ZeRORuntimeException
        assert deepspeed.DeepSpeedConfigError is ConfigError
        assert deepspeed.runtime.config.DeepSpeedConfigError is ConfigError
        assert OffloadDeviceEnum.nvme == "nvme" and len(DEFAULT_LEAF_MODULE_CLASSES) == 3

        # internals: they import, and any use raises (the stage classes answer isinstance only)
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig
        from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict
        from deepspeed.runtime.zero.partition_parameters import MultipleAllGatherHandles
        import zeroshard.deepspeed.zero_config as zc
        assert DeepSpeedZeroConfig is zc.DeepSpeedZeroConfig  # DeepSpeed's config objects, from zeroshard's config
        assert DeepSpeedZeroOffloadOptimizerConfig is zc.DeepSpeedZeroOffloadOptimizerConfig
        assert DeepSpeedZeroConfig().leaf_module.classes == DEFAULT_LEAF_MODULE_CLASSES
        from deepspeed.checkpoint.ds_to_universal import main as convert_to_universal
        assert not isinstance(object(), DeepSpeedZeroOptimizer_Stage3)
        # the module parameter dict that gathers on read is zeroshard's GatheringParams
        from zeroshard.core.zero3.param_reads import GatheringParams
        assert isinstance(ZeROOrderedDict(parent_module=None), GatheringParams)
        for internal in (DeepSpeedZeroOptimizer_Stage3, MultipleAllGatherHandles, convert_to_universal):
            try:
                internal()
            except NotYetSupportedError:
                pass
            else:
                raise AssertionError(f"{internal!r} did not raise")

        # what initialize raises for a bad config is what DeepSpeed's tests catch
        model = torch.nn.Linear(2, 2)
        try:
            deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
                "train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                "checkpoint": {"tag_validation": "foo"}})
        except deepspeed.DeepSpeedConfigError as exc:
            assert "tag_validation" in str(exc), exc
        else:
            raise AssertionError("a bad tag_validation was accepted")
        print("ok")
    """)
