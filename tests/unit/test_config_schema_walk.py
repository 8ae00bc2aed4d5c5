"""Every config key has an effect, is listed as accepted without effect, or is not yet supported.

The test walks every field of the pydantic schema recursively. A new field that is in none of the
three tables fails it, and so does a consumer entry whose file never mentions the field.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from zeroshard.config import NOT_YET_SUPPORTED, ZeroshardConfig, load_config
from zeroshard.config import no_effect as ne
from zeroshard.config.validation import _kind_of

SRC = Path(__file__).resolve().parents[2] / "src" / "zeroshard"


def _leaves(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        kind, sub = _kind_of(field.annotation)
        if kind == "model" and sub is not None:
            out += _leaves(sub, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


def _not_yet_supported(path: str) -> bool:
    return any(path == row.key or path.startswith(row.key + ".") for row in NOT_YET_SUPPORTED)


def test_every_field_is_used_listed_or_not_yet_supported() -> None:
    leaves = _leaves(ZeroshardConfig)
    assert len(leaves) > 90
    orphans = [p for p in leaves if p not in ne.CONSUMERS and p not in ne.NO_EFFECT and not _not_yet_supported(p)]
    assert not orphans, f"config keys with no consumer, no no-effect row and no not-yet-supported row: {orphans}"
    both = set(ne.CONSUMERS) & set(ne.NO_EFFECT)
    assert not both, f"listed as used and as without effect: {both}"
    stale = (set(ne.CONSUMERS) | set(ne.NO_EFFECT)) - set(leaves)
    assert not stale, f"rows for keys the schema does not have: {stale}"


@pytest.mark.parametrize("path", sorted(ne.CONSUMERS))
def test_consumer_reads_the_field(path: str) -> None:
    source = (SRC / ne.CONSUMERS[path]).read_text()
    leaf = path.rsplit(".", 1)[-1]
    assert re.search(rf"\.{leaf}\b|[\"']{leaf}[\"']", source), f"{ne.CONSUMERS[path]} never reads {path}"


def test_no_effect_warning_names_the_key_once(caplog: pytest.LogCaptureFixture) -> None:
    cfg = load_config({"train_batch_size": 2, "zero_optimization": {"round_robin_gradients": True,
                                                                     "sub_group_size": 1_000_000_000,
                                                                     "allgather_partitions": False}}, world_size=1)
    assert ne.no_effect_keys_set(cfg) == {"zero_optimization.round_robin_gradients": True,
                                          "zero_optimization.allgather_partitions": False}  # sub_group_size: default
    ne._warned.clear()
    with caplog.at_level(logging.WARNING, logger="zeroshard"):
        assert sorted(ne.warn_no_effect(cfg)) == ["zero_optimization.allgather_partitions",
                                                  "zero_optimization.round_robin_gradients"]
        assert ne.warn_no_effect(cfg) == []  # once per key
    assert "'zero_optimization.round_robin_gradients' = True has no effect" in caplog.text
    default = load_config({"train_batch_size": 2}, world_size=1)
    assert ne.no_effect_keys_set(default) == {}


def test_bf16_check_grad_overflow_accepts_deepspeeds_default() -> None:
    for value in (True, False):
        cfg = load_config({"train_batch_size": 2, "bf16": {"enabled": True, "check_grad_overflow": value}},
                          world_size=1)
        assert cfg.bf16.check_grad_overflow is value


def test_gather_16bit_weights_on_model_save_is_not_called_without_effect() -> None:
    """accelerate (so the Trainer's save_model) reads it through the engine: it has an effect."""
    cfg = load_config({"train_batch_size": 2, "zero_optimization": {
        "stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}, world_size=1)
    assert ne.no_effect_keys_set(cfg) == {}
