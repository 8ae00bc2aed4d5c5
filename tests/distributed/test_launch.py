"""``zeroshard launch`` really starts a multi-process gloo job (CPU only, two workers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from teardown import died_in_teardown, done_markers

SRC = Path(__file__).resolve().parents[2] / "src"
TIMEOUT_S = 120

WORKER = """\
import json, os, sys
from pathlib import Path

import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # rank, world size and master from the environment
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
dist.all_reduce(value)
out = Path(sys.argv[1])
record = {
    "rank": rank,
    "world_size": world,
    "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
    "allreduce": value.tolist(),
    "argv": sys.argv[2:],
}
(out / f"rank{rank}.json").write_text(json.dumps(record))
dist.destroy_process_group()
Path(f"{out}.rank{rank}.done").touch()  # the last statement: see tests/teardown.py
"""

FAILING_WORKER = """\
import os, sys
sys.exit(7 if os.environ["RANK"] == "1" else 0)
"""


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _launch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "zeroshard.cli.main", "launch", *args]


def _ended(code: int, log: str, out: Path) -> bool:
    """Exit 0, or only a teardown abort after both workers finished (:mod:`teardown`)."""
    return code == 0 or died_in_teardown("launch", log, done_markers(out))


def _check_results(out: Path, script_args: list[str]) -> None:
    records = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in records] == [0, 1]
    ports = set()
    for r in records:
        assert r["world_size"] == 2
        assert r["env"]["WORLD_SIZE"] == "2"
        assert r["env"]["RANK"] == str(r["rank"]) == r["env"]["LOCAL_RANK"]
        assert r["allreduce"] == [3.0, 30.0]  # (1 + 2), (10 + 20)
        assert r["argv"] == script_args
        ports.add(r["env"]["MASTER_PORT"])
    assert len(ports) == 1


@pytest.fixture
def worker(tmp_path: Path) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def test_launch_two_ranks_allreduce(tmp_path: Path, worker: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    # The script's own --nproc_per_node must reach the script, not the launcher.
    script_args = ["--nproc_per_node", "5", "--flag"]
    proc = subprocess.run(
        _launch_cmd("--nproc_per_node", "2", str(worker), str(out), *script_args),
        capture_output=True, text=True, env=_env(), timeout=TIMEOUT_S,
    )
    assert _ended(proc.returncode, proc.stdout + proc.stderr, out), proc.stdout + proc.stderr
    _check_results(out, script_args)


def test_two_concurrent_launches_do_not_collide(tmp_path: Path, worker: Path) -> None:
    outs = [tmp_path / "a", tmp_path / "b"]
    procs = []
    for out in outs:
        out.mkdir()
        procs.append(subprocess.Popen(
            _launch_cmd("--num_gpus", "2", str(worker), str(out)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
        ))
    try:
        logs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log, out in zip(procs, logs, outs, strict=True):
        assert _ended(p.returncode, log, out), log
        _check_results(out, [])
    ports = {json.loads((out / "rank0.json").read_text())["env"]["MASTER_PORT"] for out in outs}
    assert len(ports) == 2


def test_failed_worker_exit_code_is_returned(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(FAILING_WORKER)
    proc = subprocess.run(
        _launch_cmd("--nproc_per_node", "2", str(script)),
        capture_output=True, text=True, env=_env(), timeout=TIMEOUT_S,
    )
    assert proc.returncode == 7, proc.stdout + proc.stderr
    assert "fail.py FAILED" in proc.stderr


def test_worker_killed_by_a_signal_gives_128_plus_the_signal(tmp_path: Path) -> None:
    """The OOM killer's SIGKILL: exit 137 as a shell reports it (it was 1, like any failure)."""
    script = tmp_path / "killed.py"
    script.write_text("import os, signal, time\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    os.kill(os.getpid(), signal.SIGKILL)\n"
                      "time.sleep(2)\n")
    proc = subprocess.run(_launch_cmd("--nproc_per_node", "2", "-q", str(script)),
                          capture_output=True, text=True, env=_env(), timeout=TIMEOUT_S)
    assert proc.returncode == 128 + 9, proc.stdout + proc.stderr
    assert "Signal 9 (SIGKILL)" in proc.stderr or "SIGKILL" in proc.stderr, proc.stderr
