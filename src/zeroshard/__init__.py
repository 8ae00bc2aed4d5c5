"""zeroshard: ZeRO-sharded, mixed-precision data-parallel training for PyTorch.

Public API (DeepSpeed-compatible: ``import zeroshard as deepspeed`` runs DeepSpeed scripts):
``initialize``, ``init_distributed``, the engine type and the error types. Heavy submodules are
imported on first use so that ``import zeroshard`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zeroshard.errors import (
    CheckpointError,
    ConfigError,
    DistributedError,
    NotYetSupportedError,
    ZeroshardError,
)

__version__ = "0.1.0"

from zeroshard import moved_modules  # noqa: E402  (old module paths keep working: docs/deprecations.md)

moved_modules.install()

if TYPE_CHECKING:
    from zeroshard.core.comm.groups import init_distributed
    from zeroshard.deepspeed.accelerator import get_accelerator
    from zeroshard.deepspeed.engine import ZeroEngine
    from zeroshard.initialize import initialize

_LAZY: dict[str, tuple[str, str | None]] = {
    "initialize": ("zeroshard.initialize", "initialize"),
    "init_distributed": ("zeroshard.core.comm.groups", "init_distributed"),
    "ZeroEngine": ("zeroshard.deepspeed.engine", "ZeroEngine"),
    "get_fp32_state_dict_from_zero_checkpoint": (
        "zeroshard.checkpoint.consolidate", "get_fp32_state_dict_from_zero_checkpoint"),
    "load_state_dict_from_zero_checkpoint": (
        "zeroshard.checkpoint.consolidate", "load_state_dict_from_zero_checkpoint"),
    "zero": ("zeroshard.zero", None),
    # DeepSpeed's names (modules, engine methods, the import layer): one package wrapping the core
    "deepspeed": ("zeroshard.deepspeed", None),
    "checkpointing": ("zeroshard.deepspeed.checkpointing", None),
    "utils": ("zeroshard.deepspeed.utils", None),
    "runtime": ("zeroshard.deepspeed.runtime", None),
    "comm": ("zeroshard.deepspeed.comm", None),
    "accelerator": ("zeroshard.deepspeed.accelerator", None),
    "get_accelerator": ("zeroshard.deepspeed.accelerator", "get_accelerator"),
    # Mixture of Experts is outside zeroshard's scope: DeepSpeed's names, each use a clear error
    "moe": ("zeroshard.deepspeed.moe", None),
    # as is pipeline parallelism
    "pipe": ("zeroshard.deepspeed.pipe", None),
    "DeepSpeedConfig": ("zeroshard.config.deepspeed_config", "DeepSpeedConfig"),
    "add_config_arguments": ("zeroshard.config.deepspeed_config", "add_config_arguments"),
}
#: DeepSpeed's memory estimators, ``deepspeed.estimate_zero{2,3}_model_states_mem_needs[_all_live|_all_cold]``
_ESTIMATORS = tuple(f"estimate_zero{stage}_model_states_mem_needs{suffix}"
                    for stage in (2, 3) for suffix in ("", "_all_cold", "_all_live"))
_LAZY.update((name, ("zeroshard.estimate.formulas", name)) for name in _ESTIMATORS)

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DeepSpeedConfig",
    "DistributedError",
    "NotYetSupportedError",
    "ZeroEngine",
    "ZeroshardError",
    "__version__",
    "accelerator",
    "add_config_arguments",
    "comm",
    "checkpointing",
    "get_accelerator",
    "get_fp32_state_dict_from_zero_checkpoint",
    "init_distributed",
    "initialize",
    "load_state_dict_from_zero_checkpoint",
    "moe",
    "pipe",
    "runtime",
    "utils",
    "zero",
    *_ESTIMATORS,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        imported = importlib.import_module(module)
        value = imported if attr is None else getattr(imported, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'zeroshard' has no attribute {name!r}")
