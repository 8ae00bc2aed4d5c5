"""A DeepSpeed-style training script (``tests/data/ds_style_train.py``) under ``zeroshard launch``.

The script was written against DeepSpeed's API (``add_config_arguments``, ``--local_rank``,
``deepspeed.comm``, ``no_sync``, ``step(lr_kwargs=)``); only its import line names zeroshard. Two
processes train ZeRO stage 1 with a WarmupLR schedule; the weights must match plain PyTorch on the
same global batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from teardown import died_in_teardown

TESTS = Path(__file__).resolve().parents[1]
SRC = TESTS.parent / "src"
SCRIPT = TESTS / "data" / "ds_style_train.py"
STEPS = 4
MICRO = 4  # two halves of 2 per rank, accumulated by hand with no_sync()
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05, "warmup_num_steps": 3,
                                             "warmup_type": "linear"}}
CONFIG = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 0,
          "zero_optimization": {"stage": 1}, "optimizer": {"type": "Adam", "params": {"lr": 0.05}},
          "scheduler": SCHEDULER}


def _reference() -> list[torch.Tensor]:
    """Plain PyTorch on the same global batches, the same optimizer and the same schedule calls."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import ds_style_train as script
    finally:
        sys.path.remove(str(SCRIPT.parent))
    from zeroshard.optim import build_optimizer, build_scheduler

    model = script.build_model()
    opt = build_optimizer("Adam", {"lr": 0.05}, [{"params": list(model.parameters())}])
    sched = build_scheduler(SCHEDULER["type"], dict(SCHEDULER["params"]), opt)
    for step in range(STEPS):
        parts = [script.batches(step, rank, 2, MICRO // 2) for rank in range(2)]
        x = torch.cat([torch.cat([xs for xs, _ in p]) for p in parts])
        y = torch.cat([torch.cat([ys for _, ys in p]) for p in parts])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step(last_batch_iteration=step)
    return [p.detach().reshape(-1) for p in model.parameters()]


def _initial() -> list[torch.Tensor]:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import ds_style_train as script
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return [p.detach().reshape(-1) for p in script.build_model().parameters()]


def test_deepspeed_style_script_under_launch(tmp_path: Path) -> None:
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(CONFIG))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)}
    cmd = [sys.executable, "-m", "zeroshard.cli.main", "launch", "--nproc_per_node", "2", str(SCRIPT),
           "--deepspeed", "--deepspeed_config", str(cfg), "--steps", str(STEPS), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    exits = [tmp_path / f"exit{r}.txt" for r in (0, 1)]  # written at exit, after zeroshard's handler
    assert proc.returncode == 0 or died_in_teardown("ds_style_train", proc.stdout + proc.stderr, exits), \
        proc.stdout[-4000:] + proc.stderr[-4000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [f.read_text() for f in exits] == ["destroyed"] * 2, \
        "the script ends without destroy_process_group; zeroshard's exit handler must destroy it"
    reference = _reference()
    for rank, rec in enumerate(records):
        assert (rec["rank"], rec["world"], rec["local_rank_env"]) == (rank, 2, rank)
        assert rec["local_rank_arg"] in (-1, rank), "--local_rank, when the launcher passes it, is this rank's"
        assert rec["applied"] == [True] * STEPS and rec["saved"] is True and rec["gradient_clipping"] == 0
        assert rec["losses"] == records[0]["losses"]
        for got, ref in zip(rec["params"], reference, strict=True):
            torch.testing.assert_close(torch.tensor(got), ref, rtol=1e-5, atol=1e-6)
    moved = sum((torch.tensor(g) - w).norm().item() for g, w in zip(records[0]["params"], _initial(), strict=True))
    assert moved > 0.1, "the weights barely moved: the comparison would prove nothing"
