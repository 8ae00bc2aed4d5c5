"""Unit tests of zeroshard.config: parsing, validation, "auto" values, batch arithmetic, support table."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel

from zeroshard.config import (
    ZeroshardConfig,
    load_config,
    resolve_batch_sizes,
    support,
    to_dict,
)
from zeroshard.config.compat import ALIASES, DEEPSPEED_ONLY, DEPRECATED_OFFLOAD
from zeroshard.config.validation import _kind_of
from zeroshard.errors import ConfigError, NotYetSupportedError

CONFIGS = Path(__file__).resolve().parents[2].parent / "shared" / "configs"

needs_configs = pytest.mark.skipif(not CONFIGS.is_dir(), reason=f"{CONFIGS} not present")


def _cfg(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2}
    base.update(overrides)
    return base


def _batch(cfg: ZeroshardConfig) -> tuple[int | None, int | None, int | None]:
    return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps


# --------------------------------------------------------------------------- shared example configs


@needs_configs
@pytest.mark.parametrize(("world_size", "expected"), [(1, (32, 4, 8)), (2, (64, 4, 8)), (4, (128, 4, 8))])
def test_zero2_bf16_warmupdecay_loads(world_size: int, expected: tuple[int, int, int]) -> None:
    cfg = load_config(CONFIGS / "zero2_bf16_warmupdecay.json", world_size)
    assert _batch(cfg) == expected
    assert cfg.zero_stage == 2
    assert cfg.compute_dtype is torch.bfloat16
    assert cfg.gradient_clipping == 1.0
    assert cfg.zero_optimization.reduce_bucket_size == 50_000_000
    assert isinstance(cfg.zero_optimization.reduce_bucket_size, int)
    assert cfg.zero_optimization.overlap_comm is True
    assert cfg.scheduler is not None and cfg.scheduler.type == "WarmupDecayLR"
    assert cfg.scheduler.params["total_num_steps"] == 5000
    assert cfg.steps_per_print == 50


@needs_configs
@pytest.mark.parametrize(("world_size", "micro"), [(1, 8), (2, 4), (4, 2)])
def test_zero2_fp16_adamw_loads(world_size: int, micro: int) -> None:
    cfg = load_config(str(CONFIGS / "zero2_fp16_adamw.json"), world_size)
    assert _batch(cfg) == (32, micro, 4)
    assert cfg.compute_dtype is torch.float16
    assert cfg.dynamic_loss_scale is True
    assert cfg.optimizer is not None and cfg.optimizer.name == "adamw"
    assert cfg.optimizer.params["betas"] == [0.9, 0.999]


@needs_configs
def test_zero2_fp16_adamw_world_16_not_divisible() -> None:
    with pytest.raises(
        ConfigError, match=r"train_batch_size 32 is not divisible by .* \* 16 ranks \(= 64\)"
    ) as e:
        load_config(CONFIGS / "zero2_fp16_adamw.json", 16)
    assert e.value.key == "train_batch_size"


@needs_configs
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_zero3_tuned_loads(world_size: int) -> None:
    cfg = load_config(CONFIGS / "zero3_tuned.json", world_size)
    assert cfg.zero_stage == 3


@needs_configs
@pytest.mark.parametrize("world_size", [1, 2])
def test_offload_configs_load(world_size: int) -> None:
    cfg = load_config(CONFIGS / "zero3_offload_cpu.json", world_size)
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.zero_optimization.offload_param.device == "cpu"


@needs_configs
def test_stage3_configs_resolve_without_support_check() -> None:
    tuned = load_config(CONFIGS / "zero3_tuned.json", 2, check_support=False)
    assert _batch(tuned) == (32, 4, 4)
    zero = tuned.zero_optimization
    assert zero.stage3_max_live_parameters == 1_000_000_000
    assert zero.stage3_prefetch_bucket_size == 500_000_000
    assert zero.stage3_param_persistence_threshold == 1_000_000
    assert zero.stage3_gather_16bit_weights_on_model_save is True
    offload = load_config(CONFIGS / "zero3_offload_cpu.json", 2, check_support=False)
    assert _batch(offload) == (16, 1, 8)
    assert offload.zero_optimization.offload_optimizer.device == "cpu"
    assert offload.zero_optimization.offload_param.device == "cpu"


@needs_configs
def test_zero3_offload_cpu_world_4_not_divisible() -> None:
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps 8 \* 4 ranks \(= 32\)"):
        load_config(CONFIGS / "zero3_offload_cpu.json", 4)


@needs_configs
def test_zero_infinity_auto_values_required() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "zero_infinity_nvme.json", 2, check_support=False)
    assert e.value.key == "optimizer.params.lr"
    assert 'initialize(auto_values={"optimizer.params.lr": ...' in str(e.value)
    assert "optimizer.params.weight_decay" in str(e.value)


@needs_configs
@pytest.mark.parametrize(("world_size", "tbs"), [(1, 8), (2, 16), (4, 32)])
def test_zero_infinity_auto_values_resolved(world_size: int, tbs: int) -> None:
    auto = {"optimizer.params.lr": 3e-4, "optimizer.params.weight_decay": 0.1}
    cfg = load_config(CONFIGS / "zero_infinity_nvme.json", world_size, auto, check_support=False)
    assert _batch(cfg) == (tbs, 1, 8)
    assert cfg.optimizer is not None and cfg.optimizer.params == {"lr": 3e-4, "weight_decay": 0.1}
    off = cfg.zero_optimization.offload_optimizer
    assert off.device == "nvme" and off.nvme_path == Path("/local/nvme")
    assert cfg.zero_optimization.sub_group_size == 1_000_000_000
    assert load_config(CONFIGS / "zero_infinity_nvme.json", world_size, auto).zero_optimization == cfg.zero_optimization


# --------------------------------------------------------------------------- inputs


def test_dict_path_and_json_string_inputs_agree(tmp_path: Path) -> None:
    raw = _cfg(train_batch_size=8, fp16={"enabled": True})
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    from_dict = load_config(raw, 2)
    assert load_config(path, 2) == from_dict
    assert load_config(str(path), 2) == from_dict
    assert load_config("  \n" + json.dumps(raw), 2) == from_dict
    assert raw == _cfg(train_batch_size=8, fp16={"enabled": True})  # input dict not modified


def test_bad_json_file_names_file_and_position(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"train_batch_size": 8,\n  "fp16": {"enabled": true,}}')
    with pytest.raises(ConfigError, match=r"broken\.json.* line 2 column \d+"):
        load_config(path, 1)


def test_missing_file_names_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.json' does not exist"):
        load_config(tmp_path / "nope.json", 1)


def test_duplicate_json_key_rejected() -> None:
    with pytest.raises(ConfigError, match="duplicate key 'train_batch_size'"):
        load_config('{"train_batch_size": 8, "train_batch_size": 16}', 1)


def test_zeroshard_config_input_is_resolved_again() -> None:
    cfg = load_config(_cfg(), 3)
    assert load_config(cfg, 3) == cfg
    with pytest.raises(ConfigError, match=r"train_batch_size 6 != .* \* 4 ranks \(= 8\)"):
        load_config(cfg, 4)


def test_to_dict_round_trips_and_is_json() -> None:
    cfg = load_config(_cfg(gradient_accumulation_steps=2, bf16={"enabled": True}), 2)
    data = to_dict(cfg)
    json.dumps(data)
    assert data["train_batch_size"] == 8
    assert load_config(data, 2) == cfg


@pytest.mark.parametrize("world_size", [0, -1, 1.0, True])
def test_bad_world_size(world_size: Any) -> None:
    with pytest.raises(ConfigError, match="world_size"):
        load_config(_cfg(), world_size)


# --------------------------------------------------------------------------- batch arithmetic


@pytest.mark.parametrize(
    ("given", "world", "expected"),
    [
        ((64, 4, 8), 2, (64, 4, 8)),
        ((64, 4, None), 2, (64, 4, 8)),
        ((64, None, 8), 2, (64, 4, 8)),
        ((None, 4, 8), 2, (64, 4, 8)),
        ((64, None, None), 2, (64, 32, 1)),
        ((None, 4, None), 2, (8, 4, 1)),
    ],
)
def test_batch_arithmetic(given: tuple[Any, Any, Any], world: int, expected: tuple[int, int, int]) -> None:
    assert resolve_batch_sizes(*given, world) == expected
    raw = {
        k: v
        for k, v in zip(
            ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"),
            given,
            strict=True,
        )
        if v is not None
    }
    cfg = load_config(raw, world)
    assert _batch(cfg) == expected
    assert all(type(v) is int for v in _batch(cfg))


def test_inconsistent_batch_sizes_show_arithmetic() -> None:
    raw = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}
    with pytest.raises(ConfigError) as e:
        load_config(raw, 2)
    assert e.value.key is None
    assert str(e.value) == (
        "train_batch_size 32 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 8"
        " * 2 ranks (= 64)"
    )


@pytest.mark.parametrize("raw", [{}, {"gradient_accumulation_steps": 4}])
def test_underdetermined_batch_sizes(raw: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="set train_batch_size or train_micro_batch_size_per_gpu"):
        load_config(raw, 2)


@pytest.mark.parametrize(
    "raw", [{"train_batch_size": 7}, {"train_batch_size": 12, "gradient_accumulation_steps": 4}]
)
def test_non_divisible_batch_sizes(raw: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="is not divisible by") as e:
        load_config(raw, 2)
    assert e.value.key == "train_batch_size"


@pytest.mark.parametrize("bad", [0, -4, 2.5, "8", True])
def test_batch_size_type_and_bounds(bad: Any) -> None:
    with pytest.raises(ConfigError) as e:
        load_config({"train_batch_size": bad}, 1)
    assert e.value.key == "train_batch_size"


# --------------------------------------------------------------------------- "auto"


def test_batch_auto_derived_from_other_two() -> None:
    cfg = load_config(
        {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2
    )
    assert _batch(cfg) == (16, 4, 2)


def test_batch_auto_needs_auto_values_when_underdetermined() -> None:
    raw = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": 2,
    }
    with pytest.raises(ConfigError) as e:
        load_config(raw, 2)
    assert e.value.key == "train_batch_size"
    assert 'auto_values={"train_batch_size": ...}' in str(e.value)
    cfg = load_config(raw, 2, {"train_micro_batch_size_per_gpu": 3})
    assert _batch(cfg) == (12, 3, 2)


def test_bucket_auto_uses_deepspeed_default_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    raw = _cfg(
        zero_optimization={"stage": 2, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}
    )
    with caplog.at_level(logging.INFO, logger="zeroshard"):
        cfg = load_config(raw, 1, {"zero_optimization.stage3_prefetch_bucket_size": 1234})
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 1234
    assert "zero_optimization.reduce_bucket_size" in caplog.text and "500000000" in caplog.text


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        (_cfg(gradient_clipping="auto"), "gradient_clipping"),
        (_cfg(fp16={"enabled": "auto"}), "fp16.enabled"),
        (
            _cfg(scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}),
            "scheduler.params.warmup_max_lr",
        ),
    ],
)
def test_other_auto_needs_auto_values(raw: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(raw, 1)
    assert e.value.key == key
    assert f'\'{key}\' is "auto": pass its value in initialize(auto_values={{"{key}": ...}})' in str(e.value)


def test_auto_values_fill_and_alias_keys() -> None:
    raw = _cfg(gradient_clipping="auto", bfloat16={"enabled": "auto"})
    cfg = load_config(raw, 1, {"gradient_clipping": 0.5, "bfloat16.enabled": True})
    assert cfg.gradient_clipping == 0.5
    assert cfg.bf16.enabled is True and cfg.compute_dtype is torch.bfloat16


def test_auto_values_for_non_auto_key_must_agree() -> None:
    raw = _cfg(gradient_clipping=0.3)
    assert (
        load_config(raw, 1, {"gradient_clipping": 0.3, "train_micro_batch_size_per_gpu": 2}).gradient_clipping
        == 0.3
    )
    with pytest.raises(ConfigError, match="but the config sets 0.3") as e:
        load_config(raw, 1, {"gradient_clipping": 1.0})
    assert e.value.key == "gradient_clipping"
    with pytest.raises(ConfigError, match="does not set this key") as e:
        load_config(raw, 1, {"optimizer.params.lr": 1e-3})
    assert e.value.key == "optimizer.params.lr"


def test_auto_values_unknown_path() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'stag' \(did you mean 'stage'\?\)") as e:
        load_config(_cfg(), 1, {"zero_optimization.stag": 2})
    assert e.value.key == "zero_optimization.stag"


# --------------------------------------------------------------------------- validation errors


def test_unknown_top_level_key() -> None:
    with pytest.raises(ConfigError, match="unknown key 'foo'") as e:
        load_config(_cfg(foo=1), 1)
    assert e.value.key == "foo"


def test_dotted_top_level_keys_are_ignored_as_deepspeed_does(caplog: pytest.LogCaptureFixture) -> None:
    """TRL's prepare_deepspeed adds these three to its reference model's ZeRO-3 config; DeepSpeed reads
    keys from their blocks only, so they change nothing there (were an unknown-key error)."""
    dotted = {"zero_optimization.reduce_bucket_size": 4096, "zero_optimization.stage3_param_persistence_threshold": 640,
              "zero_optimization.stage3_prefetch_bucket_size": 0.9 * 4096}
    with caplog.at_level(logging.WARNING, logger="zeroshard"):
        cfg = load_config(_cfg(zero_optimization={"stage": 3}, **dotted), 1)
    assert cfg.zero_optimization.reduce_bucket_size == load_config(_cfg(zero_optimization={"stage": 3}), 1) \
        .zero_optimization.reduce_bucket_size != 4096
    assert all(f"'{k}'" in caplog.text for k in dotted)
    with pytest.raises(ConfigError, match="unknown key") as e:  # not a config path: still the typo error
        load_config(_cfg(**{"zero_optimization.reduce_bucket_sise": 1}), 1)
    assert e.value.key == "zero_optimization.reduce_bucket_sise"


def test_unknown_nested_key_suggests_closest() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(_cfg(zero_optimization={"stage": 1, "reduce_bucket_sise": 10}), 1)
    assert e.value.key == "zero_optimization.reduce_bucket_sise"
    assert "unknown key 'reduce_bucket_sise' (did you mean 'reduce_bucket_size'?)" in str(e.value)


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        (_cfg(pipeline={"stages": 2}), "pipeline"),
        (_cfg(moe={"enabled": True}), "moe"),
        (_cfg(hybrid_engine={"enabled": True}), "hybrid_engine"),
        (
            _cfg(zero_optimization={"stage": 3, "zero_quantized_nontrainable_weights": True}),
            "zero_optimization.zero_quantized_nontrainable_weights",
        ),
        (
            _cfg(zero_optimization={"stage": 3, "mics_shard_size": 8}),
            "zero_optimization.mics_shard_size",
        ),
        (
            _cfg(bf16={"enabled": True, "bf16_master_weights_and_grads": True}),
            "bf16.bf16_master_weights_and_grads",
        ),
    ],
)
def test_unsupported_deepspeed_feature(raw: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(raw, 1)
    assert not isinstance(e.value, NotYetSupportedError)
    assert e.value.key == key
    assert f"'{key}' is a DeepSpeed feature that zeroshard does not support" in str(e.value)


def test_inactive_deepspeed_feature_is_accepted() -> None:
    raw = _cfg(
        hybrid_engine={"enabled": False}, zero_optimization={"stage": 1, "zero_quantized_weights": False}
    )
    cfg = load_config(raw, 1)
    assert cfg.zero_stage == 1
    assert "hybrid_engine" not in to_dict(cfg)


@pytest.mark.parametrize("zero", [
    {"zero_quantized_nontrainable_weights": 0},  # read as a bool, as pydantic does
    {"mics_shard_size": 0}, {"use_multi_rank_bucket_allreduce": 1},
])
def test_deepspeeds_off_values_in_its_other_spellings_are_accepted(zero: dict[str, Any]) -> None:
    """DeepSpeed reads these values as "off" (were refused, with a hint to set the value they had)."""
    cfg = load_config(_cfg(zero_optimization={"stage": 2, **zero}), 1)
    assert not set(zero) & set(to_dict(cfg)["zero_optimization"])


@pytest.mark.parametrize("zero", [{"zero_quantized_nontrainable_weights": 1},
                                  {"mics_shard_size": 4}, {"use_multi_rank_bucket_allreduce": "no"}])
def test_deepspeeds_on_values_stay_refused(zero: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="DeepSpeed feature that zeroshard does not support"):
        load_config(_cfg(zero_optimization={"stage": 2, **zero}), 1)


@pytest.mark.parametrize(("zero", "key", "words"), [
    ({"stage": 2, "zero_quantized_weights": True}, "zero_quantized_weights", "stage 2 gathers no parameters"),
    ({"stage": 1, "zero_quantized_gradients": True}, "zero_quantized_gradients", "stage 1 all-reduces"),
    ({"stage": 2, "zero_hpz_partition_size": 8}, "zero_hpz_partition_size", "stage 2 has none"),
    ({"stage": 2, "offload_param": {"device": "cpu", "pin_memory": True}}, "offload_param", "stage 2 they stay"),
    ({"stage": 0, "offload_param": {"device": "nvme"}}, "offload_param", "stage 0 they stay"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "ratio": 0.5}},
     "offload_optimizer.ratio", "all of it on NVMe"),
])
def test_keys_deepspeed_ignores_at_this_stage_warn_and_reset(zero: dict[str, Any], key: str, words: str,
                                                              caplog: pytest.LogCaptureFixture,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed 0.19.8 accepts these (accelerate's plugin writes offload_param whatever the stage) and
    ignores them: zeroshard loads them too, names each in a warning, and the loaded config says what runs."""
    from zeroshard.config import stage_scope

    monkeypatch.setattr(stage_scope, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="zeroshard"):
        z = load_config(_cfg(zero_optimization=zero), 1).zero_optimization
    assert f"'zero_optimization.{key}'" in caplog.text and words in caplog.text, caplog.text
    assert (z.offload_param.device, z.zero_quantized_weights, z.zero_quantized_gradients,
            z.zero_hpz_partition_size, z.offload_optimizer.ratio) == ("none", False, False, 1, 1.0)
    assert z.stage == zero["stage"]


def test_keys_in_scope_are_kept_without_a_warning(caplog: pytest.LogCaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from zeroshard.config import stage_scope

    monkeypatch.setattr(stage_scope, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="zeroshard"):
        z = load_config(_cfg(zero_optimization={"stage": 3, "offload_param": {"device": "cpu"},
                                                "offload_optimizer": {"device": "cpu", "ratio": 0.5},
                                                "zero_quantized_weights": True, "zero_quantized_gradients": True,
                                                "zero_hpz_partition_size": 2}), 2).zero_optimization
        z2 = load_config(_cfg(zero_optimization={"stage": 2, "zero_quantized_gradients": True}), 2).zero_optimization
    assert "no effect here" not in caplog.text
    assert (z.offload_param.device, z.offload_optimizer.ratio, z.zero_quantized_weights,
            z.zero_hpz_partition_size) == ("cpu", 0.5, True, 2)
    assert z.zero_quantized_gradients and z2.zero_quantized_gradients


@pytest.mark.parametrize("zero", [{"zero_quantized_weights": 1, "zero_quantized_gradients": "true"},
                                  {"zero_quantized_weights": 0, "zero_quantized_gradients": False}])
def test_zeropp_quantization_is_read_at_stage_3(zero: dict[str, Any]) -> None:
    z = load_config(_cfg(zero_optimization={"stage": 3, **zero}), 1).zero_optimization
    assert z.zero_quantized_weights is z.zero_quantized_gradients is bool(zero["zero_quantized_weights"])


@pytest.mark.parametrize("value", [True, False])
def test_memory_efficient_linear_either_way(value: bool) -> None:
    """DeepSpeed-Chat's configs say false (leave F.linear alone); DeepSpeed's default is true (patch it
    to re-gather the weight in backward). zeroshard does both already: neither is an error."""
    cfg = load_config(_cfg(zero_optimization={"stage": 3, "memory_efficient_linear": value}), 1)
    assert "memory_efficient_linear" not in to_dict(cfg)["zero_optimization"]


def test_bad_type_names_key() -> None:
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage: .*integer.*'two'") as e:
        load_config(_cfg(zero_optimization={"stage": "two"}), 1)
    assert e.value.key == "zero_optimization.stage"


def test_stage_out_of_range() -> None:
    with pytest.raises(
        ConfigError, match=r"zero_optimization\.stage: Input should be less than or equal to 3"
    ):
        load_config(_cfg(zero_optimization={"stage": 4}), 1)


@pytest.mark.parametrize(("value", "ok"), [(5e7, True), (5.5e-1, False), (0, False), ("5e7", False)])
def test_bucket_size_accepts_integral_floats(value: Any, ok: bool) -> None:
    raw = _cfg(zero_optimization={"reduce_bucket_size": value})
    if ok:
        size = load_config(raw, 1).zero_optimization.reduce_bucket_size
        assert size == 50_000_000 and type(size) is int
    else:
        with pytest.raises(ConfigError) as e:
            load_config(raw, 1)
        assert e.value.key == "zero_optimization.reduce_bucket_size"


def test_fp16_and_bf16_both_enabled() -> None:
    with pytest.raises(ConfigError, match="fp16.enabled and bf16.enabled are both true"):
        load_config(_cfg(fp16={"enabled": True}, bf16={"enabled": True}), 1)


def test_bfloat16_alias_and_conflict() -> None:
    assert load_config(_cfg(bfloat16={"enabled": True}), 1).bf16.enabled is True
    with pytest.raises(ConfigError, match="same setting"):
        load_config(_cfg(bfloat16={"enabled": True}, bf16={"enabled": True}), 1)


def test_gather_16bit_alias() -> None:
    cfg = load_config(_cfg(zero_optimization={"gather_16bit_weights_on_model_save": True}), 1)
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save is True


def test_nvme_requires_path() -> None:
    raw = _cfg(zero_optimization={"stage": 3, "offload_optimizer": {"device": "nvme"}})
    with pytest.raises(ConfigError) as e:
        load_config(raw, 1, check_support=False)
    assert e.value.key == "zero_optimization.offload_optimizer.nvme_path"


def test_offload_optimizer_refused_at_stage0() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(_cfg(zero_optimization={"stage": 0, "offload_optimizer": {"device": "cpu"}}), 1)
    assert e.value.key == "zero_optimization.offload_optimizer.device"


# --------------------------------------------------------------------------- not yet supported


def test_nothing_is_listed_as_not_yet_supported() -> None:
    """Partial optimizer offload (``offload_optimizer.ratio``) was the last row; it loads at stage 3
    (``tests/unit/test_partial_offload_split.py`` checks the table still refuses a row)."""
    assert support.NOT_YET_SUPPORTED == []
    cfg = load_config(_cfg(zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}), 1)
    assert cfg.zero_optimization.offload_optimizer.ratio == 0.5


def test_default_blocks_are_supported() -> None:
    raw = _cfg(activation_checkpointing={"partition_activations": False}, tensorboard={"enabled": False})
    assert load_config(raw, 1).activation_checkpointing.partition_activations is False


# --------------------------------------------------------------------------- properties and defaults


def test_dtype_properties() -> None:
    plain = load_config(_cfg(), 1)
    assert plain.compute_dtype is torch.float32
    assert plain.grad_accum_dtype is torch.float32 and plain.reduce_dtype is torch.float32
    assert plain.dynamic_loss_scale is False
    cfg = load_config(
        _cfg(fp16={"enabled": True, "loss_scale": 128}, data_types={"grad_accum_dtype": "fp16"}), 1
    )
    assert cfg.compute_dtype is torch.float16 and cfg.dynamic_loss_scale is False
    assert cfg.grad_accum_dtype is torch.float16 and cfg.reduce_dtype is torch.float16
    cfg = load_config(
        _cfg(communication_data_type="BF16", data_types={"grad_accum_dtype": "torch.float32"}), 1
    )
    assert cfg.reduce_dtype is torch.bfloat16 and cfg.grad_accum_dtype is torch.float32
    with pytest.raises(ConfigError) as e:
        load_config(_cfg(communication_data_type="int8"), 1)
    assert e.value.key == "communication_data_type"


def test_zeroshard_defaults() -> None:
    cfg = load_config(_cfg(), 1)
    assert cfg.gradient_clipping == 1.0
    assert cfg.steps_per_print is None
    assert cfg.fp16.auto_cast is True and cfg.bf16.auto_cast is True
    assert cfg.zero_stage == 0 and cfg.zero_optimization.overlap_comm is False
    assert load_config(
        _cfg(zero_optimization={"stage": 3}), 1, check_support=False
    ).zero_optimization.overlap_comm
    assert cfg.zero_optimization.offload_optimizer.device == "none"
    assert cfg.zero_optimization.stage3_model_persistence_threshold == sys.maxsize
    assert cfg.checkpoint.tag_validation == "WARN"
    assert load_config(_cfg(checkpoint={"tag_validation": "Fail"}), 1).checkpoint.tag_validation == "FAIL"


def _models(model: type[BaseModel], seen: set[type[BaseModel]]) -> set[type[BaseModel]]:
    seen.add(model)
    for field in model.model_fields.values():
        kind, sub = _kind_of(field.annotation)
        if sub is not None and sub not in seen:
            _models(sub, seen)
    return seen


def test_every_field_documented_and_forbids_extra() -> None:
    models = _models(ZeroshardConfig, set())
    assert len(models) >= 15
    for model in models:
        assert model.model_config.get("extra") == "forbid", model
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


# --------------------------------------------------------------------------- against DeepSpeed's own code


@pytest.fixture(scope="module")
def ds() -> Any:
    return pytest.importorskip("deepspeed")


def test_top_level_defaults_match_deepspeed(ds: Any) -> None:
    from deepspeed.runtime import constants as C

    cfg = load_config(_cfg(), 1)
    assert cfg.gradient_clipping == C.GRADIENT_CLIPPING_DEFAULT
    assert cfg.steps_per_print == C.STEPS_PER_PRINT_DEFAULT
    assert cfg.prescale_gradients == C.PRESCALE_GRADIENTS_DEFAULT
    assert cfg.gradient_predivide_factor == C.GRADIENT_PREDIVIDE_FACTOR_DEFAULT
    assert cfg.communication_data_type == C.COMMUNICATION_DATA_TYPE_DEFAULT
    assert cfg.zero_allow_untested_optimizer == C.ZERO_ALLOW_UNTESTED_OPTIMIZER_DEFAULT
    assert cfg.zero_force_ds_cpu_optimizer == C.ZERO_FORCE_DS_CPU_OPTIMIZER_DEFAULT
    assert cfg.wall_clock_breakdown == C.WALL_CLOCK_BREAKDOWN_DEFAULT
    assert cfg.memory_breakdown == C.MEMORY_BREAKDOWN_DEFAULT
    assert cfg.dump_state == C.DUMP_STATE_DEFAULT
    assert cfg.checkpoint.tag_validation == C.CHECKPOINT_TAG_VALIDATION_DEFAULT
    assert cfg.checkpoint.load_universal == C.LOAD_UNIVERSAL_CHECKPOINT_DEFAULT
    assert cfg.checkpoint.use_node_local_storage == C.USE_NODE_LOCAL_STORAGE_CHECKPOINT_DEFAULT
    assert cfg.data_types.grad_accum_dtype == C.GRAD_ACCUM_DTYPE_DEFAULT
    fp16 = cfg.fp16
    assert fp16.loss_scale == C.FP16_LOSS_SCALE_DEFAULT
    assert fp16.initial_scale_power == C.FP16_INITIAL_SCALE_POWER_DEFAULT
    assert fp16.loss_scale_window == C.FP16_LOSS_SCALE_WINDOW_DEFAULT
    assert fp16.hysteresis == C.FP16_HYSTERESIS_DEFAULT
    assert fp16.consecutive_hysteresis == C.FP16_CONSECUTIVE_HYSTERESIS_DEFAULT
    assert fp16.min_loss_scale == C.FP16_MIN_LOSS_SCALE_DEFAULT
    assert C.FP16_AUTO_CAST_DEFAULT is False and fp16.auto_cast is True  # documented difference


def _common_defaults_equal(ours: BaseModel, theirs: BaseModel, skip: set[str]) -> int:
    mine = ours.model_dump(mode="json")
    other = theirs.model_dump(mode="json", by_alias=True)
    common = (set(mine) & set(other)) - skip
    for key in common:
        assert mine[key] == other[key], (
            f"{type(ours).__name__}.{key}: {mine[key]!r} != DeepSpeed {other[key]!r}"
        )
    return len(common)


def _covered(prefix: str, ours: type[BaseModel], theirs: BaseModel) -> None:
    """Every DeepSpeed key of a block is in our schema, an alias, or declared DeepSpeed-only."""
    for key in theirs.model_dump(by_alias=True):
        path = prefix + key
        assert key in ours.model_fields or path in ALIASES or path in DEEPSPEED_ONLY or path in DEPRECATED_OFFLOAD, path


def test_block_defaults_match_deepspeed(ds: Any) -> None:
    from deepspeed.comm.config import CommsLoggerConfig as DSComms
    from deepspeed.monitor import config as M
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    from zeroshard.config import (
        BF16Config,
        CometConfig,
        CommsLoggerConfig,
        CSVMonitorConfig,
        FP16Config,
        OffloadOptimizerConfig,
        OffloadParamConfig,
        TensorBoardConfig,
        WandbConfig,
        ZeroConfig,
    )

    pairs: list[tuple[str, type[BaseModel], BaseModel, set[str]]] = [
        ("zero_optimization.", ZeroConfig, DeepSpeedZeroConfig(), {"offload_optimizer", "offload_param"}),
        (
            "zero_optimization.offload_optimizer.",
            OffloadOptimizerConfig,
            DeepSpeedZeroOffloadOptimizerConfig(),
            set(),
        ),
        ("zero_optimization.offload_param.", OffloadParamConfig, DeepSpeedZeroOffloadParamConfig(), set()),
        ("fp16.", FP16Config, DeepSpeedFP16Config(), {"auto_cast"}),
        ("bf16.", BF16Config, DeepSpeedBF16Config(), set()),
        ("tensorboard.", TensorBoardConfig, M.TensorBoardConfig(), set()),
        ("csv_monitor.", CSVMonitorConfig, M.CSVConfig(), set()),
        ("wandb.", WandbConfig, M.WandbConfig(), set()),
        ("comet.", CometConfig, M.CometConfig(), set()),
        ("comms_logger.", CommsLoggerConfig, DSComms(), set()),
    ]
    for prefix, ours, theirs, skip in pairs:
        assert _common_defaults_equal(ours(), theirs, skip) > 0
        _covered(prefix, ours, theirs)


def test_other_defaults_match_deepspeed(ds: Any) -> None:
    from deepspeed.profiling import constants as P
    from deepspeed.runtime.activation_checkpointing.config import ACT_CHKPT_DEFAULT
    from deepspeed.runtime.swap_tensor.aio_config import AIO_DEFAULT_DICT

    cfg = load_config(_cfg(), 1)
    assert cfg.activation_checkpointing.model_dump() == ACT_CHKPT_DEFAULT
    assert cfg.aio.model_dump() == AIO_DEFAULT_DICT
    prof = cfg.flops_profiler
    assert prof.enabled == P.FLOPS_PROFILER_ENABLED_DEFAULT
    assert prof.recompute_fwd_factor == P.FLOPS_PROFILER_RECOMPUTE_FWD_FACTOR_DEFAULT
    assert prof.profile_step == P.FLOPS_PROFILER_PROFILE_STEP_DEFAULT
    assert prof.module_depth == P.FLOPS_PROFILER_MODULE_DEPTH_DEFAULT
    assert prof.top_modules == P.FLOPS_PROFILER_TOP_MODULES_DEFAULT
    assert prof.detailed == P.FLOPS_PROFILER_DETAILED_DEFAULT
    assert prof.output_file == P.FLOPS_PROFILER_OUTPUT_FILE_DEFAULT


@pytest.mark.parametrize("value", [True, False])
def test_bf16_immediate_grad_update_either_way(value: bool) -> None:
    """DeepSpeed's BF16_Optimizer option to add each micro-step's gradients to fp32 accumulators at
    once: what zeroshard always does (fp32 accumulation), so true is no error, and false neither."""
    cfg = load_config(_cfg(bf16={"enabled": True, "immediate_grad_update": value}), 1)
    assert cfg.bf16.enabled and cfg.grad_accum_dtype == torch.float32


def test_deprecated_cpu_offload_switches_read_as_their_blocks(caplog: pytest.LogCaptureFixture) -> None:
    """DeepSpeed still reads ``cpu_offload: true`` as ``offload_optimizer: {device: cpu}`` (and
    ``cpu_offload_param`` as ``offload_param``); older configs and tutorials have them."""
    with caplog.at_level(logging.WARNING, logger="zeroshard"):
        cfg = load_config(_cfg(zero_optimization={"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                                                  "cpu_offload_use_pin_memory": False}), 1)
    z = cfg.zero_optimization
    assert z.offload_optimizer.device == "cpu" and z.offload_param.device == "cpu"
    assert z.offload_optimizer.pin_memory is False and z.offload_param.pin_memory is False
    assert "zero_optimization.cpu_offload: true" in caplog.text and "offload_optimizer" in caplog.text
    off = load_config(_cfg(zero_optimization={"stage": 2, "cpu_offload": False}), 1).zero_optimization
    assert off.offload_optimizer is None or off.offload_optimizer.device == "none"
    with pytest.raises(ConfigError) as both:
        load_config(_cfg(zero_optimization={"stage": 2, "cpu_offload": True,
                                            "offload_optimizer": {"device": "cpu"}}), 1)
    assert both.value.key == "zero_optimization.offload_optimizer"
    with pytest.raises(ConfigError) as bad:
        load_config(_cfg(zero_optimization={"stage": 2, "cpu_offload": "yes"}), 1)
    assert bad.value.key == "zero_optimization.cpu_offload"
