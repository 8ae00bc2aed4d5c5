"""Common misuse of the engine API gets a message that says what to do (an audit run as users write
scripts, side by side with DeepSpeed 0.19.8, which is silent, hangs or gives torch's error in each):

- ``optimizer.step()`` called instead of ``engine.step()``: the accumulation window and the scheduler
  are skipped (with a warmup scheduler the learning rate stayed 0 for ever): a warning now;
- ``engine.step()`` called twice per micro-batch: each call counted a micro-step, so the optimizer
  stepped on half the micro-batches: a warning now;
- ``engine.backward(loss)`` inside ``torch.no_grad()`` failed with torch's "does not require grad"
  (plain ``loss.backward()`` works there): it backpropagates now, equal to the call outside;
- ``save_checkpoint`` under ``if rank == 0:`` is named as such; a file given as the checkpoint
  directory is called a file (it was "does not exist"); a missing directory says it is missing;
- ``model.half()`` after initialize at ZeRO-3 is named (torch's "mat1 and mat2 must have the same
  dtype" before).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import log_lines, run_distributed
from models import make_data, make_model, micro_batch

import zeroshard
from zeroshard.errors import CheckpointError, DistributedError, ZeroshardError

GLOBAL_BATCH = 8


def _config(ga: int, stage: int = 2) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ga,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}}


def _warnings(lines: list[str], fragment: str) -> list[str]:
    return [line for line in lines if fragment in line]


def misuse_worker(rank: int, world: int, mistake: str) -> dict:
    lines = log_lines()
    x, y = make_data(4, GLOBAL_BATCH)
    engine, optimizer, *_ = zeroshard.initialize(model=make_model(0), config=_config(ga=2))
    for step in range(2):
        for micro in range(2):
            xb, yb = (micro_batch(t, step, micro, rank, world, 2) for t in (x, y))
            engine.backward(engine(xb, yb))
            if mistake == "optimizer.step":
                optimizer.step()
            elif mistake == "double step":
                engine.step()
                engine.step()
            else:
                engine.step()
    engine.destroy()
    return {"lines": list(lines), "global_steps": engine.global_steps}


@pytest.mark.parametrize("mistake", ["optimizer.step", "double step", "none"])
def test_misused_step_calls_are_named(mistake: str) -> None:
    for got in run_distributed(misuse_worker, 2, mistake):
        direct = _warnings(got["lines"], "optimizer.step() was called directly")
        extra = _warnings(got["lines"], "engine.step() was called 2 times for 1 engine.backward()")
        assert len(direct) == (1 if mistake == "optimizer.step" else 0), got["lines"]
        assert len(extra) == (1 if mistake == "double step" else 0), got["lines"]
        assert got["global_steps"] == {"optimizer.step": 0, "double step": 4, "none": 2}[mistake]


def no_grad_worker(rank: int, world: int) -> dict:
    x, y = make_data(1, GLOBAL_BATCH)
    out = {}
    for where in ("outside", "inside"):
        engine, *_ = zeroshard.initialize(model=make_model(0), config=_config(ga=1))
        loss = engine(micro_batch(x, 0, 0, rank, world, 2), micro_batch(y, 0, 0, rank, world, 2))
        if where == "inside":
            with torch.no_grad():
                engine.backward(loss)
        else:
            engine.backward(loss)
        engine.step()
        out[where] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        engine.destroy()
    return out


def test_backward_inside_no_grad_backpropagates_as_outside() -> None:
    for got in run_distributed(no_grad_worker, 2):
        for name, p in got["outside"].items():
            assert torch.equal(got["inside"][name], p), name


def save_worker(rank: int, world: int, root: str) -> str:
    engine, *_ = zeroshard.initialize(model=make_model(0), config=_config(ga=1, stage=3))
    x, y = make_data(1, GLOBAL_BATCH)
    try:
        if rank == 0:
            engine.save_checkpoint(root)
        else:
            engine.backward(engine(micro_batch(x, 0, 0, rank, world, 2), micro_batch(y, 0, 0, rank, world, 2)))
    except DistributedError as e:
        return str(e)
    finally:
        engine.destroy()
    return ""


def test_save_on_rank_0_only_says_every_rank_must_call_it(tmp_path: Path) -> None:
    for message in run_distributed(save_worker, 2, str(tmp_path / "ckpt")):
        assert "save_checkpoint is collective: call it on every rank" in message, message
    assert not (tmp_path / "ckpt" / "latest").exists()


def empty_dir_worker(rank: int, world: int, workdir: str) -> list[str]:
    import os

    os.chdir(workdir)  # an empty save_dir would have saved here
    engine, *_ = zeroshard.initialize(model=make_model(0), config=_config(ga=1))
    said = []
    for save_dir in ("", None):
        try:
            engine.save_checkpoint(save_dir=save_dir)  # type: ignore[arg-type]
            said.append("saved")
        except ValueError as e:  # DeepSpeed's type (TestSaveCheckpointInvalidDir); ours is a ConfigError
            said.append(f"{type(e).__name__}: {e}")
    engine.destroy()
    return said


def test_empty_checkpoint_directory_is_refused(tmp_path: Path) -> None:
    for said in run_distributed(empty_dir_worker, 2, str(tmp_path)):
        assert said == ["ConfigError: save_dir: save_checkpoint needs a non-empty directory path, got ''",
                        "ConfigError: save_dir: save_checkpoint needs a non-empty directory path, got None"], said
    assert not list(tmp_path.iterdir()), "something was saved into the working directory"


def load_worker(rank: int, world: int, target: str) -> dict:
    lines = log_lines()
    engine, *_ = zeroshard.initialize(model=make_model(0), config=_config(ga=1))
    try:
        path, _ = engine.load_checkpoint(target)
        return {"path": path, "lines": list(lines), "error": ""}
    except CheckpointError as e:
        return {"path": None, "lines": list(lines), "error": str(e)}
    finally:
        engine.destroy()


def test_checkpoint_directory_that_is_a_file_or_missing_is_named(tmp_path: Path) -> None:
    a_file = tmp_path / "model.safetensors"
    a_file.write_bytes(b"not a directory")
    (got,) = run_distributed(load_worker, 1, str(a_file))
    assert f"checkpoint directory {a_file} is a file" in got["error"], got
    missing = tmp_path / "typo"
    (got,) = run_distributed(load_worker, 1, str(missing))
    assert got["path"] is None and not got["error"]
    assert _warnings(got["lines"], f"checkpoint directory {missing} does not exist"), got["lines"]


def half_worker(rank: int, world: int) -> str:
    engine, *_ = zeroshard.initialize(model=make_model(0), config=_config(ga=1, stage=3))
    engine.module.half()
    x, y = make_data(1, GLOBAL_BATCH)
    try:
        engine(micro_batch(x, 0, 0, rank, world, 2).half(), micro_batch(y, 0, 0, rank, world, 2))
    except ZeroshardError as e:
        return str(e)
    finally:
        engine.destroy()
    return ""


def test_stage3_dtype_change_after_initialize_is_named() -> None:
    for message in run_distributed(half_worker, 2):
        assert "its dtype was changed after initialize (model.half()" in message, message
