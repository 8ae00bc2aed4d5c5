"""Crash safety: a rank SIGKILLed at any point of a save leaves the previous checkpoint loadable.

Each case trains 2 steps, saves ``global_step2``, trains 2 more and saves ``global_step4`` with
``ZEROSHARD_CHECKPOINT_FAULT`` set, so that one rank kills itself (SIGKILL: no cleanup, no
``finally``) at a chosen phase: rank 1 with its shard file half written; rank 0 with the metadata
written but not the completion marker; rank 0 with the new directory published and the new
``latest`` written under its temporary name but not yet renamed (see ``atomic.PHASES`` for every
phase; these three cover a non-zero rank, an unpublished and a published directory). Then one job
loads every crashed directory's ``latest`` into fresh engines, checks what was and was not
published, and trains to step 6: the result must be bit-identical to a run that never crashed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from models import make_data, make_model, micro_batch
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

import zeroshard
from zeroshard.checkpoint.atomic import FAULT_ENV

WORLD, GLOBAL_BATCH, GA = 2, 8, 2
KILLS = [("shard_partial", 1), ("meta_written", 0), ("latest_partial", 0)]
CONFIG = {
    "train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": GA,
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
}


def train(engine, steps: range, rank: int) -> None:
    x, y = make_data(6, GLOBAL_BATCH)
    for step in steps:
        for m in range(GA):
            xb, yb = (micro_batch(t, step, m, rank, WORLD, GLOBAL_BATCH // (GA * WORLD)) for t in (x, y))
            engine.backward(engine(xb, yb))
            engine.step()


def crash_worker(rank: int, world: int, root: str, phase: str, victim: int) -> None:
    engine, *_ = zeroshard.initialize(model=make_model(0), config=CONFIG)
    train(engine, range(2), rank)
    engine.save_checkpoint(root)
    train(engine, range(2, 4), rank)
    os.environ[FAULT_ENV] = f"{phase}@{victim}"
    engine.save_checkpoint(root)
    raise AssertionError("the save should have been killed")


def resume_worker(rank: int, world: int, roots: list[str]) -> dict:
    engine, *_ = zeroshard.initialize(model=make_model(0), config=CONFIG)
    train(engine, range(6), rank)
    out: dict = {"reference": {n: p.detach().clone() for n, p in engine.module.named_parameters()}}
    for root in roots:
        engine, *_ = zeroshard.initialize(model=make_model(9), config=CONFIG)
        path, _ = engine.load_checkpoint(root)
        assert path.endswith("global_step2") and engine.global_steps == 2, path
        train(engine, range(2, 6), rank)
        out[root] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        try:
            engine.load_checkpoint(root, tag="global_step4")
            out[root + "/step4"] = engine.global_steps
        except zeroshard.CheckpointError as e:
            out[root + "/step4"] = str(e)
    return out


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, str]]:
    out = []
    for phase, victim in KILLS:
        root = str(tmp_path_factory.mktemp(phase))
        with pytest.raises((ProcessExitedException, ProcessRaisedException)) as info:
            run_distributed(crash_worker, WORLD, root, phase, victim, timeout=120)
        assert "should have been killed" not in str(info.value)
        out.append((phase, root))
    return out


def test_killed_save_leaves_previous_checkpoint(crashed) -> None:
    for phase, root in crashed:
        assert (Path(root) / "latest").read_text() == "global_step2", phase
        leftovers = [p.name for p in Path(root).iterdir() if p.name.startswith(".tmp-")]
        if phase == "meta_written":
            # The half-made directory is there, and a loader names it instead of reading it.
            (partial,) = (p for p in leftovers if p.startswith(".tmp-global_step4-"))
            with pytest.raises(zeroshard.CheckpointError, match=partial):
                zeroshard.get_fp32_state_dict_from_zero_checkpoint(root, tag=partial)
            with pytest.raises(zeroshard.CheckpointError, match="interrupted"):
                zeroshard.get_fp32_state_dict_from_zero_checkpoint(root, tag="global_step4")
        if phase == "latest_partial":
            assert any(p.startswith(".tmp-latest-") for p in leftovers)
        # The previous checkpoint is intact.
        names = {n for n, _ in make_model(0).named_parameters()}
        assert set(zeroshard.get_fp32_state_dict_from_zero_checkpoint(root)) == names


def test_training_resumes_exactly_after_a_crash(crashed) -> None:
    roots = [root for _, root in crashed]
    result = run_distributed(resume_worker, WORLD, roots)[0]
    ref = result["reference"]
    for phase, root in crashed:
        got = result[root]
        assert all(torch.equal(got[n], ref[n]) for n in ref), f"{phase}: resumed run differs"
        step4 = result[root + "/step4"]
        if phase == "latest_partial":
            assert step4 == 4, f"{phase}: the complete global_step4 should load ({step4})"
        else:
            assert isinstance(step4, str) and ("interrupted" in step4 or "no checkpoint" in step4), step4
