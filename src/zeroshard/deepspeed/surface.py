"""DeepSpeed's module tree as seen through :mod:`zeroshard.deepspeed.imports`: one table, module stand-ins.

Every DeepSpeed module the layer presents is a :class:`DeepSpeedModule`, a stand-in created by the
layer's import finder, never a zeroshard module renamed: zeroshard's own modules keep their names,
specs and attributes, and :func:`zeroshard.deepspeed.imports.disable` removes every stand-in. An
attribute of a stand-in is looked up, in this order, as

1. a DeepSpeed submodule listed in :data:`MODULES` (``deepspeed.zero`` is the stand-in of that name),
   unless the entry's ``names`` has the name too: as a package whose ``__init__`` imports a function
   over its submodule, ``deepspeed.utils.z3_leaf_module`` is the function while
   ``from deepspeed.utils.z3_leaf_module import ...`` reads the submodule;
2. one of the entry's ``names``: ``"zeroshard.module:attr"``, the object zeroshard provides under
   another name or in another place (``DeepSpeedEngine`` is :class:`zeroshard.deepspeed.engine.ZeroEngine`);
   dunder names too (``deepspeed.ops.__compatible_ops__``);
3. an attribute of the zeroshard modules the entry forwards to (``deepspeed.zero.Init`` is
   ``zeroshard.zero.Init``), so names zeroshard adds later appear without touching this table;
4. one of the entry's ``placeholders``: names Hugging Face code or DeepSpeed's own unit tests import
   or read (``docs/hf_probe.md``, ``docs/deepspeed_internals.md``) that zeroshard does not provide.
   Importing one works; calling it or reading its attributes raises
   :class:`~zeroshard.errors.NotYetSupportedError` naming the DeepSpeed name.

Anything else is an ``AttributeError`` (and an unknown submodule a ``ModuleNotFoundError``), as with
a real module, so feature checks such as ``hasattr(deepspeed.comm, "x")`` stay truthful.
"""

from __future__ import annotations

import importlib
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zeroshard.deepspeed.op_builder import BUILDERS
from zeroshard.errors import NotYetSupportedError

_HINT = "see docs/hf_probe.md for the DeepSpeed names zeroshard provides"


@dataclass(frozen=True)
class Entry:
    """One DeepSpeed module: where its names come from."""

    forward: tuple[str, ...] = ()
    names: dict[str, str] = field(default_factory=dict)
    placeholders: frozenset[str] = frozenset()


_ENGINE = "zeroshard.deepspeed.engine:ZeroEngine"
_ZERO_OPTIMIZER = "zeroshard.core.zero_optimizer:ZeroOptimizer"
_OPS = "zeroshard.deepspeed.ops"


def _ops(*names: str) -> dict[str, str]:
    return {name: f"{_OPS}:{name}" for name in names}


def _misc(*names: str) -> dict[str, str]:
    return {name: f"zeroshard.deepspeed.misc:{name}" for name in names}


def _zero_config(*names: str) -> dict[str, str]:
    return {name: f"zeroshard.deepspeed.zero_config:{name}" for name in names}


def _internal(*names: str) -> frozenset[str]:
    """Placeholders for DeepSpeed internals zeroshard does not provide (docs/deepspeed_internals.md)."""
    return frozenset(names)


_LEAF = "zeroshard.core.zero3.units"
_LEAF_NAMES = {n: f"{_LEAF}:{n}" for n in (
    "set_z3_leaf_modules", "unset_z3_leaf_modules", "z3_leaf_module", "get_z3_leaf_modules", "set_z3_leaf_module",
    "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix")}
#: ``deepspeed.zero`` is ``deepspeed.runtime.zero`` in DeepSpeed: names both present
_RUNTIME_ZERO = {"unwrap_model_for_generation": "zeroshard.deepspeed.runtime.zero.stage3:unwrap_model_for_generation",
                 "TiledLinear": "zeroshard.deepspeed.runtime.zero.tiling:TiledLinear",
                 "TiledLinearReturnBias": "zeroshard.deepspeed.runtime.zero.tiling:TiledLinearReturnBias",
                 "ZeroParamStatus": "zeroshard.zero.param_status:ZeroParamStatus"}
_CONFIG_ERROR = "zeroshard.errors:ConfigError"


_SCHEDULES = {name: f"zeroshard.optim:{name}"
              for name in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")}
_ACTIVATION_CKPT = Entry(forward=("zeroshard.deepspeed.checkpointing",), placeholders=frozenset(
    {"checkpoint", "configure", "is_configured", "reset", "get_cuda_rng_tracker",
     "model_parallel_cuda_manual_seed", "non_reentrant_checkpoint"}))

#: DeepSpeed module name -> where its attributes come from.
MODULES: dict[str, Entry] = {
    "deepspeed": Entry(
        forward=("zeroshard",),
        # DeepSpeed's config error is zeroshard's: what initialize raises for a bad config is what
        # ``except deepspeed.DeepSpeedConfigError`` catches
        names={"DeepSpeedEngine": _ENGINE, "DeepSpeedConfigError": _CONFIG_ERROR,
               "git_hash": "zeroshard.deepspeed.version_info:git_hash",
               "git_branch": "zeroshard.deepspeed.version_info:git_branch"},
        placeholders=frozenset({"tp_model_init", "init_inference", "add_config_arguments", "DeepSpeedConfig"})),
    "deepspeed.git_version_info": Entry(forward=("zeroshard.deepspeed.version_info",)),
    "deepspeed.comm": Entry(forward=("zeroshard.deepspeed.comm",), placeholders=frozenset(
        {"get_rank", "get_world_size", "get_local_rank", "is_initialized", "init_distributed", "barrier",
         "all_reduce", "broadcast", "all_gather", "ReduceOp"})),
    "deepspeed.zero": Entry(forward=("zeroshard.zero",), names=_RUNTIME_ZERO,
                            placeholders=frozenset({"register_external_parameter"})),
    "deepspeed.utils": Entry(forward=("zeroshard.deepspeed.utils",),
                             names={"z3_leaf_module": f"{_LEAF}:z3_leaf_module"},
                             placeholders=frozenset(
        {"logger", "log_dist", "is_initialized", "set_z3_leaf_modules", "safe_get_full_fp32_param",
         "safe_get_full_grad", "safe_set_full_fp32_param", "safe_get_full_optimizer_state",
         "z3_leaf_parameter"})),
    "deepspeed.utils.torch": Entry(names=_misc("required_torch_version")),
    "deepspeed.utils.timer": Entry(forward=("zeroshard.deepspeed.timers",)),
    "deepspeed.utils.z3_leaf_module": Entry(names=_LEAF_NAMES,
                                            placeholders=_internal("z3_leaf_parameter",
                                                                   "apply_zero_leaf_module_config")),
    "deepspeed.utils.zero_to_fp32": Entry(forward=("zeroshard.deepspeed.utils.zero_to_fp32",)),
    "deepspeed.utils.zero_to_torch": Entry(forward=("zeroshard.deepspeed.utils.zero_to_torch",)),
    "deepspeed.utils.module_utils": Entry(names=_misc("recursive_getattr", "recursive_setattr")),
    "deepspeed.utils.groups": Entry(placeholders=frozenset(
        {"_get_sequence_parallel_group", "_get_sequence_parallel_world_size", "_get_sequence_parallel_rank"})),
    "deepspeed.accelerator": Entry(forward=("zeroshard.deepspeed.accelerator",),
                                   placeholders=frozenset({"get_accelerator"})),
    "deepspeed.checkpointing": _ACTIVATION_CKPT,
    "deepspeed.compression": Entry(),
    "deepspeed.compression.helper": Entry(names=_misc("recursive_getattr", "recursive_setattr")),
    # Mixture of Experts is outside zeroshard's scope: the names import, building an expert layer raises
    "deepspeed.moe": Entry(forward=("zeroshard.deepspeed.moe",)),
    "deepspeed.moe.layer": Entry(forward=("zeroshard.deepspeed.moe.layer",)),
    "deepspeed.moe.utils": Entry(forward=("zeroshard.deepspeed.moe.utils",)),
    # DeepSpeed's own checkpoint readers (3D reshaping, universal checkpoints): zeroshard reads DeepSpeed
    # checkpoints itself (``zeroshard convert``, load_checkpoint) and provides none of these internals
    "deepspeed.checkpoint": Entry(names=_misc("get_model_ckpt_name_for_rank"), placeholders=_internal(
        "DeepSpeedCheckpoint", "ZeROCheckpoint", "get_model_3d_descriptor", "model_3d_desc",
        "UNIVERSAL_CHECKPOINT_INFO", "enable_universal_checkpoint", "SubparamShape")),
    "deepspeed.checkpoint.utils": Entry(names=_misc("clone_tensors_for_torch_save", "get_model_ckpt_name_for_rank")),
    "deepspeed.checkpoint.constants": Entry(placeholders=_internal(
        "AUTOEP_LAYERS_KEY", "AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS", "CAT_DIM", "CHECKPOINT_PARALLEL_DIMS",
        "CHECKPOINT_PP_DEGREE", "CHECKPOINT_TP_DEGREE", "FP32_FLAT_GROUPS", "FP32_WEIGHT_KEY",
        "OPTIMIZER_STATE_DICT", "PARAM", "PARAMETER_WITH_ROW_PARALLELISM_PATTERNS", "PARAMETER_WITH_SUB_PARAMS",
        "PARAM_GROUPS", "PARAM_SHAPES", "SUB_PARAM_SHAPE", "SUB_PARAM_SHARD_WIDTHS",
        "TP_REPLICATED_PARAMETER_PATTERNS", "UNIVERSAL_CHECKPOINT_INFO", "UNIVERSAL_CHECKPOINT_VERSION_KEY",
        "UNIVERSAL_CHECKPOINT_VERSION_VALUE", "VOCABULARY_PARAMETER_PATTERNS", "ZERO_STAGE")),
    "deepspeed.checkpoint.ds_to_universal": Entry(placeholders=_internal(
        "main", "merge_tp_slices", "_aggregate_autoep_zero12_metadata", "_group_per_tp_shapes",
        "_validate_autotp_conversion_support")),
    "deepspeed.checkpoint.universal_checkpoint": Entry(placeholders=_internal(
        "SubparamShape", "load_hp_checkpoint_state", "enable_universal_checkpoint", "_get_param_uc_restore_meta",
        "_resolve_autotp_partition")),
    # tensor parallelism (AutoTP) is outside zeroshard's scope
    "deepspeed.module_inject": Entry(),
    "deepspeed.module_inject.tp_shard": Entry(placeholders=_internal("get_shard_size_list")),
    "deepspeed.module_inject.layers": Entry(placeholders=_internal("LinearLayer", "LinearAllreduce")),
    "deepspeed.launcher": Entry(),
    "deepspeed.launcher.runner": Entry(names={
        "DEEPSPEED_ENVIRONMENT_NAME": "zeroshard.deepspeed.misc:DEEPSPEED_ENVIRONMENT_NAME"}),
    "deepspeed.ops": Entry(names={"__compatible_ops__": "zeroshard.deepspeed.op_builder:COMPATIBLE_OPS"}),
    "deepspeed.ops.op_builder": Entry(names={name: f"zeroshard.deepspeed.op_builder:{name}"
                                             for name in ("OpBuilder", *BUILDERS)}),
    "deepspeed.ops.aio": Entry(names={"AsyncIOBuilder": "zeroshard.deepspeed.op_builder:AsyncIOBuilder"}),
    "deepspeed.ops.adam": Entry(names=_ops("DeepSpeedCPUAdam", "FusedAdam")),
    "deepspeed.ops.adagrad": Entry(names=_ops("DeepSpeedCPUAdagrad")),
    "deepspeed.ops.lion": Entry(names=_ops("DeepSpeedCPULion", "FusedLion")),
    "deepspeed.runtime": Entry(forward=("zeroshard.deepspeed.runtime",)),
    "deepspeed.runtime.engine": Entry(names={"DeepSpeedEngine": _ENGINE},
                                      placeholders=_internal("_checkpoint_parallel_metadata")),
    # the bases of DeepSpeed's ZeRO optimizers, for isinstance tests (Lightning Fabric's load_checkpoint
    # asks whether the state holds an optimizer with them): zeroshard's one optimizer class at every stage
    "deepspeed.runtime.base_optimizer": Entry(names={"DeepSpeedOptimizer": _ZERO_OPTIMIZER,
                                                     "ZeROOptimizer": _ZERO_OPTIMIZER}),
    "deepspeed.runtime.config": Entry(names={"DeepSpeedConfig": "zeroshard:DeepSpeedConfig",
                                             "DeepSpeedConfigError": _CONFIG_ERROR},
                                      placeholders=frozenset({"DeepSpeedConfig"})),
    "deepspeed.runtime.config_utils": Entry(names={"DeepSpeedConfigError": _CONFIG_ERROR}),
    # DeepSpeed's mixed-precision optimizer wrappers: zeroshard's one optimizer class does their work at
    # every stage (deepspeed.runtime.base_optimizer.ZeROOptimizer is it)
    "deepspeed.runtime.bf16_optimizer": Entry(placeholders=_internal("BF16_Optimizer")),
    "deepspeed.runtime.fp16": Entry(),
    "deepspeed.runtime.fp16.fused_optimizer": Entry(placeholders=_internal("FP16_Optimizer")),
    "deepspeed.runtime.fp16.unfused_optimizer": Entry(placeholders=_internal("FP16_UnfusedOptimizer")),
    "deepspeed.runtime.torch_autocast": Entry(placeholders=_internal("get_comm_dtype", "has_comm_dtype")),
    "deepspeed.runtime.swap_tensor": Entry(names=_misc("MIN_SWAPPABLE_BYTES")),
    "deepspeed.runtime.checkpoint_engine": Entry(),
    "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine": Entry(
        placeholders=_internal("TorchCheckpointEngine")),
    "deepspeed.runtime.utils": Entry(names=_misc("see_memory_usage", "set_random_seed")),
    "deepspeed.runtime.dataloader": Entry(names={"RepeatingLoader": "zeroshard.deepspeed.utils:RepeatingLoader"}),
    # Pipeline parallelism is outside zeroshard's scope: the names import, building a pipeline raises
    "deepspeed.pipe": Entry(forward=("zeroshard.deepspeed.pipe",)),
    "deepspeed.runtime.pipe": Entry(forward=("zeroshard.deepspeed.pipe",)),
    "deepspeed.runtime.pipe.module": Entry(forward=("zeroshard.deepspeed.pipe",)),
    "deepspeed.runtime.pipe.topology": Entry(placeholders=_internal(
        "ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology")),
    "deepspeed.runtime.lr_schedules": Entry(names={
        **_SCHEDULES, "VALID_LR_SCHEDULES": "zeroshard.deepspeed.misc:VALID_LR_SCHEDULES"}),
    "deepspeed.runtime.activation_checkpointing": Entry(),
    "deepspeed.runtime.activation_checkpointing.checkpointing": _ACTIVATION_CKPT,
    "deepspeed.runtime.activation_checkpointing.offload_activations": Entry(
        forward=("zeroshard.deepspeed.activation_offload",)),
    "deepspeed.runtime.zero": Entry(forward=("zeroshard.deepspeed.runtime.zero", "zeroshard.zero"), names=_RUNTIME_ZERO,
                                    placeholders=frozenset({"register_external_parameter", "DeepSpeedZeRoOffload"})),
    "deepspeed.runtime.zero.tiling": Entry(forward=("zeroshard.deepspeed.runtime.zero.tiling",)),
    "deepspeed.runtime.zero.utils": Entry(forward=("zeroshard.deepspeed.runtime.zero.utils",)),
    # the stage classes answer isinstance by stage (compat/stage_classes.py); they cannot be built
    "deepspeed.runtime.zero.stage_1_and_2": Entry(forward=("zeroshard.deepspeed.runtime.zero.stage_1_and_2",), names={
        "DeepSpeedZeroOptimizer": "zeroshard.deepspeed.stage_classes:DeepSpeedZeroOptimizer"}),
    "deepspeed.runtime.zero.stage3": Entry(forward=("zeroshard.deepspeed.runtime.zero.stage3",), names={
        "DeepSpeedZeroOptimizer_Stage3": "zeroshard.deepspeed.stage_classes:DeepSpeedZeroOptimizer_Stage3"}),
    # DeepSpeed's objects of the zero_optimization block, answered from zeroshard's config
    "deepspeed.runtime.zero.config": Entry(names=_zero_config(
        "DeepSpeedZeroConfig", "DeepSpeedZeroOffloadParamConfig", "DeepSpeedZeroOffloadOptimizerConfig"),
        placeholders=_internal("ZeroStageEnum")),
    "deepspeed.runtime.zero.offload_config": Entry(names={
        **_misc("OffloadDeviceEnum"),
        "OffloadStateTypeEnum": "zeroshard.deepspeed.offload_states:OffloadStateTypeEnum",
        **_zero_config("DeepSpeedZeroOffloadParamConfig", "DeepSpeedZeroOffloadOptimizerConfig")}),
    # engine.offload_states() / reload_states(): the state names and the devices a state is on
    "deepspeed.runtime.zero.offload_states": Entry(names={
        n: f"zeroshard.deepspeed.offload_states:{n}" for n in ("get_state_devices", "OffloadStateTypeEnum")}),
    "deepspeed.runtime.zero.leaf_module_config": Entry(
        names=_misc("DEFAULT_LEAF_MODULE_CLASSES", "DEFAULT_LEAF_MODULE_NAMES", "DEFAULT_LEAF_MODULE_NAME_SUFFIXES"),
        placeholders=_internal("DeepSpeedZeroLeafModuleConfig")),
    "deepspeed.runtime.zero.parameter_offload": Entry(
        names={n: f"zeroshard.deepspeed.param_offload:{n}" for n in ("ZeROOrderedDict", "ensure_zero_ordered_dict")},
        placeholders=_internal("DeepSpeedZeRoOffload")),
    # transformers reads and restores these around zero.Init (prevent_arange_dtype_change); zeroshard's
    # zero.Init wraps no tensor constructor, so there is nothing for them to do until they are called.
    "deepspeed.runtime.zero.partition_parameters": Entry(
        forward=("zeroshard.zero",),
        names={"get_accelerator": "zeroshard.deepspeed.accelerator:get_accelerator",
               "ZeroParamStatus": "zeroshard.zero.param_status:ZeroParamStatus",
               "partitioned_param_data_shape": "zeroshard.deepspeed.misc:partitioned_param_data_shape"},
        placeholders=frozenset({"zero_wrapper_for_fp_tensor_constructor", "_orig_torch_arange",
                                "get_accelerator", "register_external_parameter"}) | _internal(
            "MultipleAllGatherHandles", "InsertPostInitMethodToModuleSubClasses", "CUDAQuantizer",
            "get_allgather_dtype", "zero3_linear_wrap")),
    "deepspeed.runtime.sequence_parallel": Entry(),
    "deepspeed.runtime.sequence_parallel.ulysses_sp": Entry(placeholders=frozenset(
        {"UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"})),
}

#: Placeholders for names that issue #10's DeepSpeed surface adds to zeroshard (status in the probe).
ISSUE_10 = frozenset({
    "deepspeed.add_config_arguments", "deepspeed.DeepSpeedConfig", "deepspeed.runtime.config.DeepSpeedConfig",
    "deepspeed.comm.get_rank", "deepspeed.comm.get_world_size", "deepspeed.comm.get_local_rank",
    "deepspeed.comm.is_initialized", "deepspeed.comm.barrier", "deepspeed.comm.all_reduce",
    "deepspeed.accelerator.get_accelerator", "deepspeed.runtime.zero.partition_parameters.get_accelerator",
    "deepspeed.utils.logger", "deepspeed.utils.log_dist", "deepspeed.utils.safe_get_full_fp32_param",
    "deepspeed.utils.safe_get_full_grad", "deepspeed.utils.safe_set_full_fp32_param",
    "deepspeed.utils.safe_get_full_optimizer_state",
    "deepspeed.zero.register_external_parameter", "deepspeed.runtime.zero.register_external_parameter",
})


class _NotYetSupportedType(type):
    """Metaclass of placeholders: calling one, or reading a public attribute of it, raises."""

    _ds_name: str

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise not_yet_supported(cls._ds_name)

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # probes such as copy, inspect and typing expect AttributeError
        raise not_yet_supported(f"{cls._ds_name}.{name}")

    def __repr__(cls) -> str:
        return f"<{cls._ds_name}: not supported by zeroshard yet>"


def not_yet_supported(ds_name: str) -> NotYetSupportedError:
    """The error raised when a DeepSpeed name without a zeroshard implementation is used."""
    return NotYetSupportedError(
        f"{ds_name} is not supported by zeroshard yet: zeroshard.deepspeed.imports presents DeepSpeed's module "
        f"surface, and this name can be imported but has no implementation ({_HINT})")


def placeholder(ds_name: str) -> type:
    """A class standing for ``ds_name``: importable, ``isinstance`` is False, any use raises."""
    return _NotYetSupportedType(ds_name.rsplit(".", 1)[-1], (), {"_ds_name": ds_name, "__module__": __name__})


def is_placeholder(obj: object) -> bool:
    """Whether ``obj`` is a placeholder made by :func:`placeholder`."""
    return isinstance(obj, _NotYetSupportedType)


def _import_attr(target: str) -> Any:
    """``"pkg.module:attr"`` -> the attribute; ``ImportError``/``AttributeError`` when absent."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _optional_module(name: str) -> types.ModuleType | None:
    """The zeroshard module, or ``None`` when this zeroshard does not have it (yet)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and name.startswith(exc.name):
            return None  # the module itself is absent; an import error inside it propagates
        raise


class DeepSpeedModule(types.ModuleType):
    """A DeepSpeed module name backed by zeroshard, resolved attribute by attribute (see module doc)."""

    def __init__(self, name: str, entry: Entry) -> None:
        super().__init__(name, f"zeroshard's stand-in for DeepSpeed's {name} (zeroshard.deepspeed.imports)")
        self._zs_entry = entry
        # Scripts locate DeepSpeed by it (``os.path.dirname(deepspeed.__file__)`` in version banners
        # and environment reports): the file of the layer that presents it.
        self.__file__ = str(Path(__file__).with_name("imports.py"))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__") and name not in self._zs_entry.names:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = _lookup(self.__name__, self._zs_entry, name)
        setattr(self, name, value)  # cached, as a from-import or a real module attribute would be
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        entry = self.__dict__.get("_zs_entry")
        if isinstance(value, DeepSpeedModule) and entry is not None and name in entry.names:
            # the import system binds a loaded submodule on its parent; where the entry names an object
            # of that name (a package that imports a function over its submodule), the object stays
            return
        super().__setattr__(name, value)

    def __repr__(self) -> str:
        return f"<module {self.__name__!r} (zeroshard's stand-in)>"

    def __dir__(self) -> list[str]:
        names = set(super().__dir__()) | set(self._zs_entry.names) | set(self._zs_entry.placeholders)
        names |= {m.rsplit(".", 1)[1] for m in MODULES if m.rsplit(".", 1)[0] == self.__name__}
        for target in self._zs_entry.forward:
            module = _optional_module(target)
            names |= set(getattr(module, "__all__", ())) if module else set()
        return sorted(names)


def _lookup(ds_module: str, entry: Entry, name: str) -> Any:
    child = f"{ds_module}.{name}"
    if child in MODULES and name not in entry.names:
        return importlib.import_module(child)  # through the layer's finder: the child stand-in
    if name in entry.names:
        try:
            return _import_attr(entry.names[name])
        except (ImportError, AttributeError):
            if name not in entry.placeholders:
                raise
    for target in entry.forward:
        module = _optional_module(target)
        if module is not None and (value := getattr(module, name, _ABSENT)) is not _ABSENT:
            return value
    if name in entry.placeholders:
        return placeholder(child)
    raise AttributeError(f"module {ds_module!r} has no attribute {name!r} in zeroshard's DeepSpeed "
                         f"compatibility layer ({_HINT})")


_ABSENT = object()


def resolve(dotted: str) -> Any:
    """The object a DeepSpeed dotted name gives while the layer is enabled (``deepspeed.zero.Init``).

    Raises:
        AttributeError, ImportError: the layer does not know the name.
    """
    parts = dotted.split(".")
    obj: Any = importlib.import_module(parts[0])
    for part in parts[1:]:
        obj = getattr(obj, part)
    return obj
