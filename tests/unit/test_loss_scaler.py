"""Loss scaling follows DeepSpeed's DynamicLossScaler step for step (hysteresis, window, minimum)."""

from __future__ import annotations

import random

import pytest

from zeroshard.core.precision import DynamicLossScaler, LossScaler

CASES = [
    dict(init_scale=2.0**16, scale_window=1000, min_scale=1.0, hysteresis=2, consecutive_hysteresis=False),
    dict(init_scale=2.0**8, scale_window=5, min_scale=4.0, hysteresis=1, consecutive_hysteresis=False),
    dict(init_scale=2.0**10, scale_window=3, min_scale=1.0, hysteresis=3, consecutive_hysteresis=True),
]


@pytest.mark.parametrize("kwargs", CASES)
def test_matches_deepspeed(kwargs: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    monkeypatch.setattr(ds.dist, "get_rank", lambda *a, **k: 0)  # its log line asks for a rank
    theirs = ds.DynamicLossScaler(
        init_scale=kwargs["init_scale"], scale_window=kwargs["scale_window"], min_scale=kwargs["min_scale"],
        delayed_shift=kwargs["hysteresis"], consecutive_hysteresis=kwargs["consecutive_hysteresis"],
        raise_error_at_min_scale=False,
    )
    ours = DynamicLossScaler(**kwargs, raise_error_at_min_scale=False)
    rng = random.Random(0)
    for i in range(400):
        overflow = rng.random() < (0.3 if i < 100 else 0.02)
        theirs.update_scale(overflow)
        ours.update(overflow)
        assert ours.scale == theirs.cur_scale, f"step {i}"


def test_scale_never_below_minimum_and_state_round_trip() -> None:
    s = DynamicLossScaler(init_scale=8.0, min_scale=2.0, hysteresis=1, raise_error_at_min_scale=False)
    for _ in range(5):
        s.update(True)
    assert s.scale == 2.0
    strict = DynamicLossScaler(init_scale=4.0, min_scale=2.0, hysteresis=1)
    strict.update(True)
    with pytest.raises(FloatingPointError, match="minimum loss scale 2"):
        strict.update(True)
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()


def test_static_scale_is_constant() -> None:
    s = LossScaler(128.0)
    s.update(True)
    s.update(False)
    assert s.scale == 128.0


def test_optimizer_exposes_deepspeeds_loss_scaling_attributes() -> None:
    """Scripts log ``engine.optimizer.loss_scaler.cur_scale`` and read ``dynamic_loss_scale`` (DeepSpeed's
    ZeRO optimizers); they were AttributeErrors. The values follow the scale through an overflow."""
    import torch
    import torch.distributed as dist

    import zeroshard

    created = not dist.is_initialized()
    try:
        model = torch.nn.Linear(4, 3)
        engine, opt, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config={
            "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}, "gradient_clipping": 0,
            "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 1},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        assert opt.dynamic_loss_scale is True and opt.custom_loss_scaler is False and opt.external_loss_scale is None
        assert opt.loss_scaler.cur_scale == opt.loss_scaler.loss_scale == opt.cur_scale == 256.0
        assert opt.loss_scaler.cur_hysteresis == 1
        x = torch.ones(2, 4, dtype=torch.float16)
        engine.backward(engine(x).float().sum() * float("inf"))  # an overflow: skipped, the scale halves
        engine.step()
        assert not engine.was_step_applied() and opt.loss_scaler.cur_scale == 128.0 == opt.cur_scale
        engine.destroy()
        model = torch.nn.Linear(4, 3)
        _, static, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config={
            "train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True, "loss_scale": 64},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        assert static.dynamic_loss_scale is False and static.loss_scaler.cur_scale == 64.0
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
