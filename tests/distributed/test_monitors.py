"""Monitors after a short 2-rank run, read back from disk; the default log lines of a bare script.

Two configs run in one spawned job: ZeRO-3 in fp32 and ZeRO-1 in fp16 (the only precision with a
``loss_scale`` scalar), both with the TensorBoard and CSV monitors, ``wall_clock_breakdown`` and
``steps_per_print`` 2 over 5 steps. The files are read back (TensorBoard through the tensorboard
package's reader): every step's ``train_loss`` at x = global samples equals the mean over the ranks
of the losses each rank saw, ``lr`` follows the scheduler, and after step 5 (mid-interval) the files
already hold every step's ``lr`` (written at each step, as DeepSpeed) and steps 1-4's losses (written
per interval, after the ranks' average): flushed without closing.
"""

from __future__ import annotations

import csv
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from models import make_data, make_model, micro_batch

import zeroshard

STEPS, GA, BATCH, EVERY = 5, 2, 8, 2
TAG = "Train/Samples/"
CASES = {"zero3_fp32": (3, False), "zero1_fp16": (1, True)}


def config(out: str, job: str, stage: int, fp16: bool) -> dict:
    return {
        "train_batch_size": BATCH, "gradient_accumulation_steps": GA, "gradient_clipping": 1.0,
        "steps_per_print": EVERY, "wall_clock_breakdown": True,
        "fp16": {"enabled": fp16, "initial_scale_power": 8}, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 4, "warmup_type": "linear"}},
        "tensorboard": {"enabled": True, "output_path": out, "job_name": job + "_tb"},
        "csv_monitor": {"enabled": True, "output_path": out, "job_name": job + "_csv"},
    }


def _csv(path: Path) -> list[tuple[int, float]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return [(int(s), float(v)) for s, v in rows[1:]]


def worker(rank: int, world: int, out: str) -> dict:
    x, y = make_data(STEPS, BATCH)
    result: dict = {}
    for job, (stage, fp16) in CASES.items():
        engine, *_ = zeroshard.initialize(model=make_model(0), config=config(out, job, stage, fp16))
        losses, lrs = [], []
        for step in range(STEPS):
            window = 0.0
            for m in range(GA):
                xb, yb = (micro_batch(t, step, m, rank, world, BATCH // (GA * world)) for t in (x, y))
                loss = engine(xb, yb)
                engine.backward(loss)
                engine.step()
                window += float(loss) / GA
            losses.append(window)
            lrs.append(engine.get_lr()[0])
        # Step 5 ends no interval: what is on disk now is what a crash here would leave.
        rows = _csv(Path(out) / f"{job}_csv" / "Train_Samples_train_loss.csv") if rank == 0 else []
        lr_rows = _csv(Path(out) / f"{job}_csv" / "Train_Samples_lr.csv") if rank == 0 else []
        result[job] = {"losses": torch.tensor(losses, dtype=torch.float64), "lrs": torch.tensor(lrs),
                       "rows_before_close": len(rows), "lr_rows_before_close": len(lr_rows)}
    return result


def test_monitor_files_after_two_rank_run(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    results = run_distributed(worker, 2, str(tmp_path), timeout=400)
    steps = STEPS - STEPS % EVERY  # losses written so far: whole intervals
    xs = [BATCH * (s + 1) for s in range(steps)]
    every_x = [BATCH * (s + 1) for s in range(STEPS)]  # the host numbers: every step, as DeepSpeed
    for job, (_stage, fp16) in CASES.items():
        mean_loss = (results[0][job]["losses"] + results[1][job]["losses"]) / 2
        lrs = results[0][job]["lrs"].tolist()
        assert results[0][job]["rows_before_close"] == steps
        assert results[0][job]["lr_rows_before_close"] == STEPS  # flushed at each step

        (event_file,) = (tmp_path / f"{job}_tb").iterdir()  # rank 0 alone writes
        acc = EventAccumulator(str(event_file))
        acc.Reload()
        tags = set(acc.Tags()["scalars"])
        expected = {TAG + t for t in ("train_loss", "lr", "grad_norm", "samples_per_sec", "tokens_per_sec",
                                      "elapsed_time_ms_forward", "elapsed_time_ms_backward",
                                      "elapsed_time_ms_backward_inner", "elapsed_time_ms_backward_allreduce",
                                      "elapsed_time_ms_step")}
        expected -= {TAG + "tokens_per_sec"}  # float features: no token count
        assert expected <= tags, (job, tags)
        assert (TAG + "loss_scale" in tags) == fp16
        assert (TAG + "elapsed_time_ms_gather" in tags) == (job == "zero3_fp32")
        loss = acc.Scalars(TAG + "train_loss")
        assert [e.step for e in loss] == xs
        torch.testing.assert_close(torch.tensor([e.value for e in loss], dtype=torch.float64),
                                   mean_loss[:steps], rtol=1e-6, atol=0)
        assert [e.step for e in acc.Scalars(TAG + "lr")] == every_x
        torch.testing.assert_close(torch.tensor([e.value for e in acc.Scalars(TAG + "lr")]),
                                   torch.tensor(lrs), rtol=1e-6, atol=0)
        assert all(e.value > 0 for e in acc.Scalars(TAG + "elapsed_time_ms_step"))

        csv_dir = tmp_path / f"{job}_csv"
        csv_loss = _csv(csv_dir / "Train_Samples_train_loss.csv")
        assert [s for s, _ in csv_loss] == xs
        torch.testing.assert_close(torch.tensor([v for _, v in csv_loss], dtype=torch.float64),
                                   mean_loss[:steps], rtol=1e-6, atol=0)
        assert [s for s, _ in _csv(csv_dir / "Train_Samples_lr.csv")] == every_x


SCRIPT = textwrap.dedent("""
    import logging, os, sys, torch
    import zeroshard
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    if sys.argv[2] == "configured":
        logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="APP %(name)s %(message)s")
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 2, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for step in range(4):
        ids = torch.randint(0, 16, (2, 6), device=engine.device)
        loss = torch.nn.functional.cross_entropy(engine(ids).flatten(0, 1), ids.flatten())
        engine.backward(loss)
        engine.step()
    if sys.argv[2] == "bare":
        engine.save_checkpoint(sys.argv[3])
        engine.load_checkpoint(sys.argv[3])
""")


def test_default_log_lines_on_stderr(tmp_path: Path) -> None:
    """No logging configured: the report lines, and checkpoint save/load with size and time, appear
    on stderr. Configured: they go to the application's handler only, once."""
    path = tmp_path / "bare.py"
    path.write_text(SCRIPT)
    bare = subprocess.run([sys.executable, str(path), "29541", "bare", str(tmp_path / "ckpt")], capture_output=True,
                          text=True, timeout=180)
    assert bare.returncode == 0, bare.stderr
    lines = [ln for ln in bare.stderr.splitlines() if " step=" in ln]
    assert [ln.split(" step=")[1].split()[0] for ln in lines] == ["2", "4"], bare.stderr
    for field in ("samples=", "loss=", "lr=1.000e-03", "loss_scale=1", "grad_norm=", "skipped=0", "step_time=",
                  "samples/s=", "tokens/s=", "mem: host="):
        assert field in lines[1], (field, lines[1])
    assert "initialized in" in bare.stderr and bare.stdout == ""
    assert re.search(r"saved checkpoint .*global_step4: [0-9.]+ MiB of shards in [0-9.]+ s", bare.stderr), bare.stderr
    assert re.search(r"loaded checkpoint .*: [0-9.]+ MiB in [0-9.]+ s", bare.stderr), bare.stderr

    configured = subprocess.run([sys.executable, str(path), "29542", "configured"], capture_output=True, text=True,
                                timeout=180)
    assert configured.returncode == 0, configured.stderr
    assert " step=" not in configured.stderr
    assert [ln.split()[1:3] for ln in configured.stdout.splitlines() if "step=" in ln] == [
        ["zeroshard", "step=2"], ["zeroshard", "step=4"]]
