"""Fault-injection trials: a 2-rank job under ``zeroshard launch`` loses a rank, and must end.

One :func:`run_trial` launches ``tests/fault_train.py`` with a fault (a rank SIGKILLed or
SIGSTOPped at a forward, backward, optimizer step or checkpoint save of some step) and checks:

- without restarts, the job ends within the collective timeout plus :data:`MARGIN_S` (start-up
  and steps; torchrun would give a stopped worker, which holds SIGTERM pending, 30 s before
  SIGKILL, but ``zeroshard launch`` continues it so that it acts on the SIGTERM at once), with a
  non-zero exit and an error that names the lost rank;
- with ``--max_restarts 1``, it ends with exit 0 and the final parameters of an uninterrupted run;
- either way no process of the job is left, and the latest checkpoint, if any, is complete and
  loads.

Used by ``tests/distributed/test_faults.py`` (a few trials) and ``scripts/fault_trials.py`` (many).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from teardown import died_in_teardown, done_markers

SCRIPT = Path(__file__).resolve().parent / "fault_train.py"
TIMEOUT_S = 5.0
MARGIN_S = 35.0
STEPS = 6
POINTS = ("forward", "backward", "step", "save")


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    point: str
    kind: str  # "kill" or "stop"

    @staticmethod
    def draw(seed: int) -> Fault:
        r = random.Random(seed)
        point = r.choice(POINTS)
        step = r.choice([1, 3, 5]) if point == "save" else r.randrange(STEPS)  # saves follow odd steps
        return Fault(r.randrange(2), step, point, r.choice(["kill", "stop"]))

    def env(self) -> str:
        return f"{self.rank}:{self.step}:{self.point}:{self.kind}"


@dataclass
class Outcome:
    code: int
    seconds: float
    stderr: str
    params: dict[str, torch.Tensor] | None
    leftovers: list[int]
    latest_ok: bool | None  # None: no checkpoint was completed


def _job_pids(token: str) -> list[int]:
    """Processes whose command line mentions ``token`` (the trial's own directory)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if token in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def run_trial(workdir: Path, fault: Fault | None, restarts: int = 0, stage: int = 2) -> Outcome:
    """Launch the job once with ``fault`` and return what happened."""
    trial = workdir / f"trial-{uuid.uuid4().hex[:8]}"
    trial.mkdir(parents=True)
    out = trial / "final.safetensors"
    cmd = [sys.executable, "-m", "zeroshard.cli.main", "launch", "--nproc_per_node", "2",
           "--max_restarts", str(restarts), "--monitor_interval", "0.5", str(SCRIPT), "--steps", str(STEPS),
           "--stage", str(stage), "--ckpt", str(trial / "ckpt"), "--out", str(out), "--timeout", str(TIMEOUT_S)]
    env = {**os.environ, "ZEROSHARD_TEST_FAULT": fault.env() if fault else "", "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=TIMEOUT_S + MARGIN_S + 60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        stderr += "\n[trial] the job hung: killed by the trial"
    seconds = time.monotonic() - start
    time.sleep(0.5)
    leftovers = _job_pids(str(trial))
    for pid in leftovers:  # never leave them to the next trial, but report them
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    params = None
    if out.is_file():
        from safetensors.torch import load_file

        params = load_file(out)
    latest_ok = None
    if (trial / "ckpt" / "latest").is_file():
        import zeroshard

        try:
            zeroshard.get_fp32_state_dict_from_zero_checkpoint(trial / "ckpt")
            latest_ok = True
        except Exception as e:  # reported by the caller
            stderr += f"\n[trial] latest checkpoint does not load: {e}"
            latest_ok = False
    code = proc.returncode
    if code != 0 and died_in_teardown("fault trial", stderr, done_markers(out)):
        code = 0  # every rank finished; one died in torch's teardown after that (tests/teardown.py)
    return Outcome(code, seconds, stderr, params, leftovers, latest_ok)


def check(outcome: Outcome, fault: Fault, restarts: int, reference: dict[str, torch.Tensor]) -> list[str]:
    """What went wrong in one trial (empty: it behaved)."""
    problems = []
    if outcome.leftovers:
        problems.append(f"processes left behind: {outcome.leftovers}")
    if outcome.latest_ok is False:
        problems.append("the latest checkpoint is corrupt")
    if restarts:
        if outcome.code != 0 or outcome.params is None:
            problems.append(f"did not recover: exit {outcome.code}\n{outcome.stderr[-2000:]}")
        else:
            diff = max((outcome.params[k] - reference[k]).abs().max().item() for k in reference)
            if diff > 1e-6:
                problems.append(f"recovered to other parameters (max abs difference {diff:.2e})")
        return problems
    if outcome.code == 0:
        problems.append("the job reported success although a rank was lost")
    if outcome.seconds > TIMEOUT_S + MARGIN_S:
        problems.append(f"took {outcome.seconds:.0f} s, over the timeout {TIMEOUT_S} + margin {MARGIN_S}")
    if not names_the_lost_rank(outcome.stderr, fault):
        problems.append(f"no error naming rank {fault.rank} as lost:\n{outcome.stderr[-3000:]}")
    return problems


def names_the_lost_rank(stderr: str, fault: Fault) -> bool:
    """A surviving rank's DistributedError names the lost rank from its heartbeats, or, when the
    lost rank died (SIGKILL) and torchrun tore the job down first, torchrun's report names it as
    the root cause, killed by the signal."""
    ours = any(f"rank {fault.rank}: {what}" in stderr for what in ("stopped or dead", "no heartbeat"))
    if "DistributedError" in stderr and ours:
        return True
    if fault.kind != "kill" or "Root Cause" not in stderr:
        return False
    cause = stderr.split("Root Cause", 1)[1]
    return f"rank      : {fault.rank} (local_rank" in cause and "SIGKILL" in cause
