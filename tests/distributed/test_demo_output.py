"""The demo's screen as a newcomer reads it: no torchrun internals before the first line of ours, and each
progress report once (a line per report in a log; the bar only on a terminal)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_prints_progress_once_without_torchrun_internals() -> None:
    env = {k: v for k, v in os.environ.items() if k != "LOGLEVEL"}
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run(
        [sys.executable, "-m", "zeroshard.cli.main", "launch", "--nproc_per_node", "2", "examples/train_gpt.py",
         "--config", "examples/configs/stage2.json", "--steps", "4", "--log_interval", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert not re.search(r"^[IW]\d{4} \d\d:\d\d:\d\d", out, re.M), out[:3000]  # torchrun's glog-style lines
    assert "rendezvous" not in out and "signal handler" not in out, out[:3000]
    assert "\r" not in out  # no bar in a log
    for step in (1, 2, 4):
        assert len(re.findall(rf"^step +{step} \| loss [0-9.]+", out, re.M)) == 1, out
    assert len(re.findall(r"^step ", out, re.M)) == 3, out
    assert re.search(r"^\[zeroshard\] done: 4 steps .* tokens/s after step 1 \| OK$", out, re.M), out
