"""Engine calls that accelerate and the Trainer make, on one process: the accumulation boundary set by
hand (accelerate calls ``step()`` once per window), ``engine.config.get`` (the Trainer reads the config as
DeepSpeed's dict), ``steps_per_print: inf`` (accelerate's way to silence DeepSpeed) and the ZeRO-3-only
consolidated state dict."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.config import load_config

GAS = 3


def _engine(stage: int = 1) -> zeroshard.deepspeed.engine.ZeroEngine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    engine, *_ = zeroshard.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    return engine


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 4, generator=g) for _ in range(2 * GAS)]


def test_boundary_set_by_hand_matches_counting(process_group: None) -> None:
    counted, by_hand = _engine(), _engine()
    for x in _batches():  # DeepSpeed's own loop: step() after every micro-batch
        counted.backward(counted(x).pow(2).mean())
        counted.step()
    for i, x in enumerate(_batches()):  # accelerate's: the boundary set before each backward, step() at it
        boundary = i % GAS == GAS - 1
        by_hand.set_gradient_accumulation_boundary(boundary)
        assert by_hand.is_gradient_accumulation_boundary() is boundary
        by_hand.backward(by_hand(x).pow(2).mean())
        if boundary:
            by_hand.step()
    assert by_hand.global_steps == counted.global_steps == 2
    assert by_hand.micro_steps == counted.micro_steps == 2 * GAS  # window starts, as checkpoints expect
    for a, b in zip(by_hand.module.parameters(), counted.module.parameters()):
        assert torch.equal(a, b)
    moved = _engine()
    assert any(not torch.equal(a, b) for a, b in zip(moved.module.parameters(), counted.module.parameters()))


def test_config_reads_as_deepspeeds_dict(process_group: None) -> None:
    engine = _engine(stage=2)
    assert engine.config.get("zero_optimization", {}).get("stage") == 2
    assert engine.config.get("gradient_accumulation_steps") == GAS
    assert engine.config.get("no_such_key", "default") == "default"


def test_infinite_steps_per_print_means_never() -> None:
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "steps_per_print": float("inf")}, world_size=1)
    assert cfg.steps_per_print is None
    with pytest.raises(zeroshard.errors.ConfigError, match="steps_per_print"):
        load_config({"train_micro_batch_size_per_gpu": 1, "steps_per_print": float("-inf")}, world_size=1)


def test_consolidated_state_dict_is_zero3_only(process_group: None) -> None:
    engine = _engine(stage=2)
    with pytest.raises(ValueError, match="ZeRO-3"):
        engine._zero3_consolidated_16bit_state_dict()
    stage3 = _engine(stage=3)
    state = stage3._consolidated_16bit_state_dict()
    reference = {k: v for k, v in _engine(stage=0).module.state_dict().items()}
    assert state.keys() == reference.keys()
    for k, v in reference.items():
        assert torch.equal(state[k], v), k
