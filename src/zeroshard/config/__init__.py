"""DeepSpeed-compatible training config for zeroshard.

Typical use::

    from zeroshard.config import load_config

    cfg = load_config("ds_config.json", world_size=8, auto_values={"optimizer.params.lr": 1e-4})
    cfg.train_micro_batch_size_per_gpu, cfg.zero_stage, cfg.compute_dtype

:func:`load_config` accepts DeepSpeed's JSON schema (key names and 0.19.x defaults), rejects unknown keys
and DeepSpeed features zeroshard lacks with a :class:`~zeroshard.errors.ConfigError` naming the key, and
raises :class:`~zeroshard.errors.NotYetSupportedError` for features listed in :data:`NOT_YET_SUPPORTED`.
"""

from __future__ import annotations

from zeroshard.config.batch import BATCH_KEYS, resolve_batch_sizes
from zeroshard.config.blocks import (
    ActivationCheckpointingConfig,
    AIOConfig,
    CheckpointConfig,
    CometConfig,
    CommsLoggerConfig,
    CSVMonitorConfig,
    FlopsProfilerConfig,
    OptimizerConfig,
    SchedulerConfig,
    TensorBoardConfig,
    WandbConfig,
)
from zeroshard.config.fields import DTYPES
from zeroshard.config.load import ConfigSource, load_config, read_config, to_dict
from zeroshard.config.precision import BF16Config, DataTypesConfig, FP16Config
from zeroshard.config.schema import ZeroshardConfig
from zeroshard.config.support import NOT_YET_SUPPORTED, NotYetSupported, check_supported
from zeroshard.config.zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "AIOConfig",
    "ActivationCheckpointingConfig",
    "BATCH_KEYS",
    "BF16Config",
    "CSVMonitorConfig",
    "CheckpointConfig",
    "CometConfig",
    "CommsLoggerConfig",
    "ConfigSource",
    "DTYPES",
    "DataTypesConfig",
    "FP16Config",
    "FlopsProfilerConfig",
    "NOT_YET_SUPPORTED",
    "NotYetSupported",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "TensorBoardConfig",
    "WandbConfig",
    "ZeroConfig",
    "ZeroshardConfig",
    "check_supported",
    "load_config",
    "read_config",
    "resolve_batch_sizes",
    "to_dict",
]
