"""``accelerate launch --use_deepspeed`` on zeroshard (issue 13): one real launch through accelerate's
own launcher (``torch.distributed.run`` inside it), 2 CPU workers, ZeRO-3 with the stage, accumulation
and clipping given as launcher flags, via ``python -m zeroshard.deepspeed.accelerate_launch``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("accelerate") is None or importlib.util.find_spec("accelerate.commands.launch") is None:
    pytest.skip("accelerate's CLI (accelerate.commands.launch) is not installed (pip install 'zeroshard[hf]')",
                allow_module_level=True)
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'zeroshard[hf]')")

SCRIPT = Path(__file__).resolve().parent / "accelerate_launch_script.py"
# the test extras install DeepSpeed
LAUNCH = [sys.executable, "-m", "zeroshard.deepspeed.accelerate_launch", "--shadow"]


def test_accelerate_launch_use_deepspeed_trains_on_zeroshard(tmp_path: Path) -> None:
    flags = ["--use_deepspeed", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
             "--dynamo_backend", "no", "--zero_stage", "3", "--gradient_accumulation_steps", "2",
             "--gradient_clipping", "0.5", "--main_process_port", "0"]
    done = subprocess.run([*LAUNCH, *flags, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["deepspeed"].startswith("0.19.8+zeroshard"), r  # the workers' `import deepspeed` is zeroshard
        assert r["engine"] == "zeroshard.deepspeed.engine.ZeroEngine", r
        # the launcher's flags reached the engine through accelerate's environment
        assert (r["distributed_type"], r["world"], r["stage"], r["gas"], r["clip"]) == (
            "DistributedType.DEEPSPEED", 2, 3, 2, 0.5), r
        losses = r["losses"]
        assert r["optimizer_steps"] == len(losses) // 2 == 4, r
        assert sum(losses[-2:]) < 0.95 * sum(losses[:2]), (rank, losses)


def test_deepspeed_multinode_launchers_are_refused_by_name(tmp_path: Path) -> None:
    done = subprocess.run([*LAUNCH, "--use_deepspeed", "--num_machines", "2", "--num_processes", "4",
                           "--deepspeed_multinode_launcher", "pdsh", str(SCRIPT), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--deepspeed_multinode_launcher pdsh" in done.stderr and "standard" in done.stderr, done.stderr[-2000:]
