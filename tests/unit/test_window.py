"""The accumulation window (window.py) on its own: boundaries counted or set by hand, the counters a
boundary step moves, the warning for extra step() calls, losses kept on the device."""

from __future__ import annotations

import torch

from zeroshard.core.clock import StepClock
from zeroshard.window import AccumulationWindow


def _window(ga: int) -> AccumulationWindow:
    steps = {"ga": ga}
    return AccumulationWindow(lambda: steps["ga"], StepClock(), torch.device("cpu"))


def test_counted_boundaries_and_counters() -> None:
    w = _window(3)
    seen = []
    for _ in range(6):  # DeepSpeed's loop: one step() per backward
        w.backwards += 1
        boundary = w.is_boundary()
        seen.append(boundary)
        if boundary:
            w.close()
            w.stepped(applied=True, samples=8)
        else:
            w.count_micro_step()
    assert seen == [False, False, True, False, False, True]
    assert (w.micro_steps, w.global_steps, w.global_samples, w.skipped_steps) == (6, 2, 16, 0)
    assert w.clock() == 2 and w.position == 0 and w.backwards == 0
    w.stepped(applied=False, samples=8)
    assert (w.global_steps, w.skipped_steps, w.step_applied) == (3, 1, False)


def test_boundary_set_by_hand_starts_a_whole_window() -> None:
    w = _window(4)
    w.boundary_override = False
    assert not w.is_boundary()
    w.count_micro_step()
    w.boundary_override = True  # accelerate: step() only at its boundary, after 2 of 4 micro-steps here
    assert w.is_boundary()
    w.close()
    assert w.micro_steps == 4 and w.position == 0  # the counter starts the next window of 4


def test_extra_step_calls_are_reported_once() -> None:
    w = _window(2)
    w.backwards = 1
    w.count_micro_step()  # a second step() call in the window, with one backward
    assert w.step_calls() == 2 and w.first_extra_step()
    assert not w.first_extra_step()  # once


def test_recount_after_a_change_of_accumulation_steps() -> None:
    steps = {"ga": 2}
    w = AccumulationWindow(lambda: steps["ga"], StepClock(5), torch.device("cpu"))
    steps["ga"] = 3
    w.recount_from_steps()
    assert w.micro_steps == 15 and w.position == 0


def test_mean_loss_stays_a_tensor_until_cleared() -> None:
    w = _window(2)
    w.add_loss(torch.tensor(1.0))
    w.add_loss(torch.tensor([2.0, 1.0]))  # a per-sample loss counts as its sum, as the engine logs it
    mean = w.mean_loss()
    assert isinstance(mean, torch.Tensor) and float(mean) == 2.0
    w.clear_losses()
    assert float(w.mean_loss()) == 0.0
