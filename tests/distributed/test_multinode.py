"""``zeroshard launch`` across "machines", all on this one (CPU, gloo, one process per node).

* The same command on every node (the README's Slurm recipe: ``--num_nodes $SLURM_NNODES --node_rank
  $SLURM_NODEID --master_addr $MASTER`` with node ids 0 and 1 and ``MASTER=127.0.0.1``) and a
  hostfile job started over "ssh" reach bit for bit the parameters of a one-node run of the same
  world size; the training script declares ``--local_rank`` and needs it.
* "ssh" is a fake ``ssh`` first on ``PATH`` that records its arguments and runs the remote command
  here with bash, so the launcher's real code path runs: the commands it starts are the ones
  ``--dry-run`` prints, and ``.deepspeed_env`` reaches the workers.
* When one host fails, the other host's processes are stopped, the launcher exits with the failed
  host's code, and no process of the job is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file
from teardown import died_in_teardown, done_markers

TESTS = Path(__file__).resolve().parents[1]
SRC = TESTS.parent / "src"
TRAIN = TESTS / "multinode_train.py"
TIMEOUT_S = 300

FAKE_SSH = """\
#!/bin/bash
# Stands in for ssh: records its arguments (NUL-separated), then runs the remote command here.
printf '%s\\0' "$@" > "$FAKE_SSH_LOG/$$.args"
while [ $# -gt 0 ]; do
  case "$1" in -p|-o|-l|-i) shift 2 ;; -*) shift ;; *) break ;; esac
done
shift  # the host name
exec bash -c "$*"
"""

FAILING = """\
import os, sys, time
from pathlib import Path

out = Path(sys.argv[1])
(out / f"pid{os.environ['RANK']}").write_text(str(os.getpid()))
if os.environ["RANK"] == "1":  # node 1 fails once node 0's worker runs
    deadline = time.monotonic() + 120
    while not (out / "pid0").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    sys.exit(7)
time.sleep(600)  # node 0 would run for 10 minutes unless the launcher stops it
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp: Path) -> dict[str, str]:
    """PYTHONPATH with src/; the fake ssh first on PATH; HOME here, so no user .deepspeed_env is read."""
    fake_bin = tmp / "bin"
    fake_bin.mkdir(exist_ok=True)
    ssh = fake_bin / "ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    log = tmp / "ssh_log"
    log.mkdir(exist_ok=True)
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}",
            "HOME": str(tmp), "FAKE_SSH_LOG": str(log)}


def _launch(*args: str) -> list[str]:
    return [sys.executable, "-m", "zeroshard.cli.main", "launch", *args]


def _start(cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> tuple[subprocess.Popen, Path]:
    with log.open("w") as f:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT), log


def _wait(jobs: dict[str, tuple[subprocess.Popen, Path]], done: list[Path]) -> None:
    """Wait for every job; fail at the first that exits non-zero, or at the deadline, with every log
    (a node that fails leaves the other waiting in torchrun's exit barrier: its log says why). A job
    whose only failure is a teardown abort after every rank wrote its ``done`` marker passes with a
    warning (:mod:`teardown`); the others are then stopped, as they would wait 300 s for it."""
    deadline = time.monotonic() + TIMEOUT_S

    def logs() -> str:
        return "".join(f"\n--- {name} (exit {proc.poll()}):\n{log.read_text()[-4000:]}"
                       for name, (proc, log) in jobs.items())

    try:
        while True:
            failed = [name for name, (proc, _) in jobs.items() if proc.poll() not in (None, 0)]
            if any(died_in_teardown(name, jobs[name][1].read_text(), done) for name in failed):
                return
            assert not failed, f"{failed} failed:{logs()}"
            if all(proc.poll() == 0 for proc, _ in jobs.values()):
                return
            assert time.monotonic() < deadline, f"still running after {TIMEOUT_S} s:{logs()}"
            time.sleep(0.2)
    finally:
        for proc, _ in jobs.values():
            if proc.poll() is None:
                proc.kill()


def _records(out: Path) -> list[dict]:
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]


def test_every_launch_form_reaches_the_one_node_parameters(tmp_path: Path) -> None:
    env = _env(tmp_path)
    (tmp_path / ".deepspeed_env").write_text("# forwarded to every host\nZS_TEST_MARK=from env file\n")
    (tmp_path / "hostfile").write_text("nodeA slots=1\nnodeB slots=1  # both are this machine\n")
    outs = {name: tmp_path / f"{name}.safetensors" for name in ("one_node", "node0", "hostfile")}
    port, hostfile_port = _free_port(), _free_port()
    train = [str(TRAIN), "--steps", "4", "--out"]
    # What srun runs once per node in the README's Slurm recipe ("the same command on every node").
    node = ["bash", "-c", shlex.join(_launch()) + " --num_nodes $SLURM_NNODES --node_rank $SLURM_NODEID "
            "--master_addr $MASTER --master_port $PORT --num_gpus 1 \"$@\"", "node", *train, str(outs["node0"])]
    slurm = [{**env, "SLURM_NNODES": "2", "SLURM_NODEID": str(r), "MASTER": "127.0.0.1", "PORT": str(port)}
             for r in range(2)]
    hostfile = ["--hostfile", "hostfile", "--launcher", "ssh", "--ssh_port", "2222", "--master_addr", "127.0.0.1",
                "--master_port", str(hostfile_port), "--rdzv_id", "multinode-test"]

    dry = subprocess.run(_launch(*hostfile, "--dry-run", *train, str(outs["hostfile"])), cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert dry.returncode == 0, dry.stderr
    printed = [shlex.split(line) for line in dry.stdout.splitlines()]
    assert [cmd[:4] for cmd in printed] == [["ssh", "-p", "2222", "nodeA"], ["ssh", "-p", "2222", "nodeB"]]

    # One launch form at a time (the two nodes of the Slurm form together): all at once, 8 training
    # processes on the 2-core CI machine made a rank abort in gloo now and then.
    _wait({"one node, 2 processes": _start(_launch("--num_gpus", "2", *train, str(outs["one_node"])),
                                           tmp_path, env, tmp_path / "one_node.log")}, done_markers(outs["one_node"]))
    _wait({"node 0 of 2": _start(node, tmp_path, slurm[0], tmp_path / "node0.log"),
           "node 1 of 2": _start(node, tmp_path, slurm[1], tmp_path / "node1.log")}, done_markers(outs["node0"]))
    _wait({"hostfile over ssh": _start(_launch(*hostfile, *train, str(outs["hostfile"])),
                                       tmp_path, env, tmp_path / "hostfile.log")}, done_markers(outs["hostfile"]))

    expected = load_file(outs["one_node"])
    for name in ("node0", "hostfile"):
        got = load_file(outs[name])
        assert got.keys() == expected.keys()
        for key, tensor in expected.items():
            assert got[key].equal(tensor), f"{name}: {key} differs from the one-node run"
    for name in outs:
        records = _records(outs[name])
        assert [r["world_size"] for r in records] == [2, 2]
        assert [r["local_rank_arg"] for r in records] == [int(r["env"]["LOCAL_RANK"]) for r in records]
        nodes = [r["env"]["GROUP_RANK"] for r in records]
        assert nodes == (["0", "0"] if name == "one_node" else ["0", "1"]), (name, nodes)
        mark = "from env file" if name == "hostfile" else None
        assert [r["env"]["ZS_TEST_MARK"] for r in records] == [mark, mark]
    started = sorted(p.read_bytes().rstrip(b"\0").split(b"\0") for p in (tmp_path / "ssh_log").glob("*.args"))
    assert started == sorted([arg.encode() for arg in cmd[1:]] for cmd in printed)  # what --dry-run printed


def test_one_failed_host_stops_the_others(tmp_path: Path) -> None:
    env = _env(tmp_path)
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "hostfile").write_text("nodeA slots=1\nnodeB slots=1\n")
    try:
        # Without teardown, node 0's worker would hold the launcher's output pipes for 10 minutes.
        proc = subprocess.run(
            _launch("--hostfile", "hostfile", "--launcher", "ssh", "--master_addr", "127.0.0.1",
                    "--master_port", str(_free_port()), str(script), str(out)),
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150,
        )
        assert proc.returncode == 7, proc.stdout + proc.stderr
        assert "host nodeB (node 1) exited with code 7" in proc.stderr
        pid = int((out / "pid0").read_text())
        deadline = time.monotonic() + 30
        while _job_processes(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _job_processes(tmp_path), "processes of the job are left"
        assert _state(pid) in ("Z", "gone"), f"node 0's worker {pid} is still running"
    finally:
        for pid in _job_processes(tmp_path):  # a failed run must not leave its processes to the next test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _state(pid: int) -> str:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "gone"
    return next((line.split()[1] for line in status.splitlines() if line.startswith("State:")), "?")


def _job_processes(tmp: Path) -> list[int]:
    """Live processes whose command line names the test's directory (the job's, nobody else's)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if str(tmp).encode() in cmdline and _state(int(entry.name)) not in ("Z", "gone"):
            found.append(int(entry.name))
    return found


pytestmark = pytest.mark.skipif(not Path("/proc").is_dir() or sys.platform != "linux",
                                reason="fake ssh and process checks need Linux (bash, /proc)")
