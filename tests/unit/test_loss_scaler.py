"""Loss scaling follows DeepSpeed's DynamicLossScaler step for step (hysteresis, window, minimum)."""

from __future__ import annotations

import random

import pytest

from zeroshard.precision import DynamicLossScaler, LossScaler

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
