"""Checkpoint tags as DeepSpeed's: any plain name, ``latest`` included (without colliding with the
``latest`` file), ``checkpoint.tag_validation`` Warn / Ignore / Fail across ranks, and the
``zero_to_fp32.py`` script that every checkpoint folder receives."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from models import make_model

import zeroshard
from zeroshard.checkpoint import atomic, paths
from zeroshard.checkpoint.tags import SCRIPTS, check_tag
from zeroshard.errors import CheckpointError

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def _trained_engine(stage: int = 1, validation: str = "Warn"):
    engine, *_ = zeroshard.initialize(model=make_model(0), config={
        **CONFIG, "zero_optimization": {"stage": stage}, "checkpoint": {"tag_validation": validation}})
    x, y = torch.randn(4, 11), torch.randint(0, 5, (4,))
    engine.backward(engine(x, y))
    engine.step()
    return engine


def test_check_tag_rules(tmp_path: Path) -> None:
    assert check_tag("latest", tmp_path, save_latest=False) == "latest"  # DeepSpeed accepts any tag
    assert check_tag("epoch 3, step 7", tmp_path, save_latest=True) == "epoch 3, step 7"
    with pytest.raises(CheckpointError, match="save_latest=True.*'latest' file"):
        check_tag("latest", tmp_path, save_latest=True)
    (tmp_path / "latest").write_text("global_step1")
    with pytest.raises(CheckpointError, match=r"latest is the file naming the newest checkpoint"):
        check_tag("latest", tmp_path, save_latest=False)
    for bad in ("a/b", ".hidden", "", "x\0y"):
        with pytest.raises(CheckpointError, match="invalid checkpoint tag"):
            check_tag(bad, tmp_path, save_latest=False)


def test_resolving_the_tag_latest(tmp_path: Path) -> None:
    (tmp_path / "latest").mkdir()  # a checkpoint saved under the tag 'latest', as DeepSpeed allows
    (tmp_path / "latest" / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert paths.resolve_checkpoint(tmp_path, "latest") == tmp_path / "latest"
    assert paths.resolve_checkpoint(tmp_path, None) is None  # no 'latest' *file*: nothing to resume
    other = tmp_path / "other"
    (other / "global_step4").mkdir(parents=True)
    (other / "global_step4" / "mp_rank_00_model_states.pt").write_bytes(b"")
    atomic.write_file_atomic(other / "latest", b"global_step4")
    assert paths.resolve_checkpoint(other, "latest") == other / "global_step4"  # the file's tag
    atomic.write_file_atomic(other / "latest", b"latest")
    with pytest.raises(CheckpointError, match="names 'latest', which is not a checkpoint tag"):
        paths.resolve_checkpoint(other, None)


def test_save_and_load_under_the_tag_latest(tmp_path: Path, process_group: None) -> None:
    engine = _trained_engine()
    with pytest.raises(CheckpointError, match="save_latest=True"):
        engine.save_checkpoint(tmp_path, tag="latest")
    assert not any(tmp_path.iterdir()), "nothing may be written before the tag is refused"
    engine.save_checkpoint(tmp_path, tag="latest", save_latest=False)
    fresh, *_ = zeroshard.initialize(model=make_model(3), config={**CONFIG, "zero_optimization": {"stage": 1}})
    path, _ = fresh.load_checkpoint(tmp_path, tag="latest")
    assert path == str(tmp_path / "latest") and fresh.global_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(fresh.module.parameters(), engine.module.parameters()))


def test_recovery_scripts_consolidate_the_folder(tmp_path: Path, process_group: None) -> None:
    """DeepSpeed 0.19.8 leaves zero_to_fp32.py and zero_to_torch.py (``--dtype``) in every checkpoint
    folder (zero_to_torch.py was missing)."""
    engine = _trained_engine(stage=2)
    engine.save_checkpoint(tmp_path / "ckpt")
    for name, extra, dtype in (("zero_to_fp32.py", [], torch.float32), ("zero_to_torch.py", ["--dtype", "bf16"],
                                                                         torch.bfloat16)):
        script = tmp_path / "ckpt" / name
        assert script.is_file() and os.access(script, os.X_OK)
        out = tmp_path / f"out-{name}"
        subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), str(out), *extra], check=True,
                       timeout=120, capture_output=True)
        got = torch.load(out / "pytorch_model.bin", weights_only=True)
        want = zeroshard.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
        assert list(got) == list(want) and all(torch.equal(got[k], want[k].to(dtype)) for k in want), name
        assert all(torch.equal(got[n], p.to(dtype)) for n, p in engine.module.named_parameters())
    # the top-level name takes DeepSpeed's keyword arguments too (it lacked exclude_frozen_parameters)
    assert zeroshard.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt", exclude_frozen_parameters=True,
                                                              lazy_mode=True).keys() == want.keys()


def tag_worker(rank: int, world: int, root: str) -> dict:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("zeroshard").addHandler(handler)
    out = {}
    for mode in ("Warn", "Ignore", "Fail"):
        engine = _trained_engine(validation=mode)
        records.clear()
        try:
            engine.save_checkpoint(f"{root}/{mode}", tag=f"step1-rank{rank}")
            out[mode] = sorted(p.name for p in Path(f"{root}/{mode}").iterdir())
        except CheckpointError as e:  # also an AssertionError, as DeepSpeed's (its test_tag_validation.py)
            out[mode] = f"AssertionError={isinstance(e, AssertionError)}: {e}"
        out[f"{mode} warned"] = any("not the same on all ranks" in m for m in records)
    return out


def test_tag_validation_modes(tmp_path: Path) -> None:
    for rank, got in enumerate(run_distributed(tag_worker, 2, str(tmp_path), timeout=300)):
        for mode, warned in (("Warn", True), ("Ignore", False)):  # saved under rank 0's tag
            assert got[mode] == sorted(["latest", "step1-rank0", *SCRIPTS]), (rank, mode, got[mode])
            assert got[f"{mode} warned"] is warned, (rank, mode)
        assert "tag_validation is 'Fail'" in got["Fail"] and "ranks [1] differ" in got["Fail"], got["Fail"]
        assert got["Fail"].startswith("AssertionError=True"), got["Fail"]
    assert not (tmp_path / "Fail").exists()
