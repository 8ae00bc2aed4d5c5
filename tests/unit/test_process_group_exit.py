"""``init_distributed`` destroys the group it created when the script ends, and only after a clean end.

A script that never calls ``destroy_process_group`` (most DeepSpeed scripts) must not leave the group
to the interpreter's teardown, where gloo aborts the process now and then. After an uncaught
exception the group is left alone: destroying it would wait on collectives peers may never finish.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

SCRIPT = """
import atexit, sys
import torch.distributed as dist
sys.path.insert(0, {src!r})
import zeroshard
# Registered first, so it runs last: after zeroshard's own handler.
atexit.register(lambda: print("at exit:", "initialized" if dist.is_initialized() else "destroyed", flush=True))
zeroshard.init_distributed()
if {crash}:
    raise RuntimeError("the training loop failed")
"""


@pytest.mark.parametrize(("crash", "code", "state"), [(False, 0, "destroyed"), (True, 1, "initialized")])
def test_group_destroyed_at_a_clean_exit_only(crash: bool, code: int, state: str) -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(src=str(SRC), crash=crash)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stderr
    assert f"at exit: {state}" in proc.stdout, proc.stdout + proc.stderr
