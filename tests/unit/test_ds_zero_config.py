"""DeepSpeed's ``runtime.zero.config`` objects, answered from zeroshard's config (one process).

The cases are DeepSpeed's own (tests/unit/runtime/zero/test_zero_config.py), which build its
``DeepSpeedZeroConfig`` to read a block as the engine will; a ``null`` offload block is also what
DeepSpeed's schema allows in a config file, and zeroshard's loading now reads it as no offload.
"""

from __future__ import annotations

import pytest

from zeroshard.config import load_config
from zeroshard.deepspeed.zero_config import (
    DeepSpeedZeroConfig,
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
)
from zeroshard.errors import ConfigError


def test_deprecated_and_alias_fields_read_by_deepspeeds_names() -> None:
    assert isinstance(DeepSpeedZeroConfig(cpu_offload_param=True).offload_param, DeepSpeedZeroOffloadParamConfig)
    assert isinstance(DeepSpeedZeroConfig(cpu_offload=True).offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig)
    assert DeepSpeedZeroConfig(stage3_gather_fp16_weights_on_model_save=True).gather_16bit_weights_on_model_save
    assert DeepSpeedZeroConfig(stage3_prefetch_bucket_size=12345).prefetch_bucket_size == 12345
    assert DeepSpeedZeroConfig(stage3_param_persistence_threshold=12345).param_persistence_threshold == 12345
    assert DeepSpeedZeroConfig(stage3_max_reuse_distance=12345).max_reuse_distance == 12345


def test_stage_dependent_defaults_and_offload_blocks() -> None:
    assert [DeepSpeedZeroConfig(stage=s).overlap_comm for s in range(4)] == [False, False, False, True]
    assert not DeepSpeedZeroConfig(stage=2).pipeline_loading_checkpoint
    for given in ({}, {"offload_param": None, "offload_optimizer": None}):
        c = DeepSpeedZeroConfig(**given)
        assert c.offload_param is None and c.offload_optimizer is None
    c = DeepSpeedZeroConfig(offload_param={}, offload_optimizer={})
    assert c.offload_param.device == "none" and c.offload_optimizer.device == "none"  # type: ignore[union-attr]
    assert not DeepSpeedZeroOffloadOptimizerConfig().pipeline
    assert DeepSpeedZeroOffloadOptimizerConfig(pipeline_read=True).pipeline
    assert DeepSpeedZeroOffloadOptimizerConfig(pipeline_write=True).pipeline


def test_leaf_module_strings_and_bad_values() -> None:
    c = DeepSpeedZeroConfig(leaf_module={"classes": "my.Class", "names": "sub", "name_suffixes": "tail"})
    assert (c.leaf_module.classes, c.leaf_module.names, c.leaf_module.name_suffixes) == (["my.Class"], ["sub"],
                                                                                          ["tail"])
    with pytest.raises(ConfigError) as e:
        DeepSpeedZeroConfig(stage=7)
    assert e.value.key == "zero_optimization.stage"
    with pytest.raises(AttributeError, match="no_such_thing"):
        _ = DeepSpeedZeroConfig().no_such_thing


def test_null_offload_blocks_in_a_config_file() -> None:
    cfg = load_config({"train_batch_size": 2, "zero_optimization": {"stage": 2, "offload_optimizer": None,
                                                                     "offload_param": None}}, world_size=1)
    assert cfg.zero_optimization.offload_optimizer.device == "none"
    assert cfg.zero_optimization.offload_param.device == "none"


def test_keys_of_features_zeroshard_lacks_read_back_as_given() -> None:
    """The object reads a block (DeepSpeed's test_zeropp reads hpZ's size from it); the config
    loader ignores hpZ below stage 3 with a warning, as DeepSpeed ignores it there, and refuses the
    size where the ranks of a node are known (initialize: tests/distributed/test_zeropp.py)."""
    assert DeepSpeedZeroConfig(zero_hpz_partition_size=4).zero_hpz_partition_size == 4
    assert load_config({"train_batch_size": 2, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}},
                       1).zero_optimization.zero_hpz_partition_size == 4
    assert load_config({"train_batch_size": 2, "zero_optimization": {"stage": 2, "zero_hpz_partition_size": 4}},
                       1).zero_optimization.zero_hpz_partition_size == 1


def test_ensure_zero_ordered_dict_as_deepspeeds_helper() -> None:
    """DeepSpeed's parameter_offload helpers: a plain dict becomes a ZeROOrderedDict (zeroshard's
    GatheringParams, gathering nothing outside an engine), the first container is kept once."""
    import torch

    from zeroshard.deepspeed.param_offload import ZeROOrderedDict, ensure_zero_ordered_dict

    m = torch.nn.Linear(4, 4, bias=False)
    plain = dict(m._parameters)
    m._parameters = plain
    ensure_zero_ordered_dict(m)
    assert isinstance(m._parameters, ZeROOrderedDict) and "weight" in m._parameters
    assert m._original_parameters is plain and m.weight is plain["weight"]
    converted = m._parameters
    ensure_zero_ordered_dict(m)
    assert m._parameters is converted and m._original_parameters is plain
    ensure_zero_ordered_dict(object())  # nothing to convert: no error
    assert not isinstance({}, ZeROOrderedDict)


def test_elastic_checkpoint_at_stage_3_says_it_is_deprecated(caplog: pytest.LogCaptureFixture) -> None:
    """DeepSpeed's words (its test_elastic_checkpoint_is_deprecated_for_zero3 matches them)."""
    with caplog.at_level("WARNING", logger="zeroshard"):
        DeepSpeedZeroConfig(stage=3, elastic_checkpoint=True)
        assert "elastic checkpointing is deprecated" in caplog.text.lower()
        caplog.clear()
        DeepSpeedZeroConfig(stage=2, elastic_checkpoint=True)
        assert "elastic" not in caplog.text
