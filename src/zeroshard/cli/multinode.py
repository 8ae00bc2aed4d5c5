"""``zeroshard launch`` across machines: one ``zeroshard launch`` (torchrun) per host, started over
ssh or pdsh, and the whole job torn down when one host fails.

``launch.py`` parses the command line and resolves the hosts (``hostfile.py``); this module turns
them into commands and runs those. Host ``i`` of the active resources runs, in the launcher's
working directory and with the forwarded environment::

    ssh [-p PORT] HOST 'cd CWD || exit 1; export K=V; ...; exec PYTHON -u -m zeroshard.cli.main launch
        --rdzv_id TAG --node_rank i --nnodes N --nproc_per_node SLOTS --master_addr ADDR
        --master_port PORT [torchrun options] SCRIPT [args]'

that is torchrun's static rendezvous on ``ADDR:PORT`` (the first host by default), so the global
ranks follow the hostfile's order, as in DeepSpeed (torchrun's c10d rendezvous orders nodes by
address and process id instead; ``--rdzv_backend c10d --rdzv_endpoint`` are forwarded when given).
Every host decides for itself whether to pass ``--local_rank`` (``launch.py``).

Environment forwarded (DeepSpeed's rules): the launcher's variables whose names start with
``MLFLOW``, ``PYTHON``, ``MV2``, ``UCX`` or ``NCCL``, and also ``ZEROSHARD`` (this library's knobs);
``PYTHONPATH`` gets the working directory in front; then the ``KEY=VALUE`` lines of
``~/.deepspeed_env`` and ``./.deepspeed_env`` (the name is ``$DS_ENV_FILE`` when set), whose values
the remote shell expands (``PATH=$PATH:/opt/bin`` works, as in DeepSpeed).

Teardown: when a host's command exits non-zero, every other host gets ``pkill -TERM -f`` for the
job's tag over ssh (torchrun then stops its workers, giving them 30 s), then the local ssh clients
are terminated; the launcher exits with the failed host's code.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from zeroshard.cli.hostfile import ResourceError, visible_devices

#: Name prefixes of the variables DeepSpeed's launcher forwards (EXPORT_ENVS + CUDA's NCCL), plus ours.
EXPORT_PREFIXES = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL", "ZEROSHARD")
#: Never forwarded: set by each host's own launch.
LOCAL_ONLY = frozenset({"ZEROSHARD_LAUNCH_ATTEMPT"})
LAUNCHERS = ("ssh", "pdsh")
#: DeepSpeed's other ``--launcher`` values: jobs for them are started with ``srun``/``mpirun``
#: around a per-node ``zeroshard launch`` instead (docs/launching.md).
UNSUPPORTED_LAUNCHERS = ("openmpi", "mpich", "impi", "mvapich", "slurm")
PDSH_FAN_OUT = 1024
KILL_WAIT_S = 15.0
#: After the kill commands: torchrun gives its workers 30 s to exit after SIGTERM.
GRACE_S = 40.0
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Remote:
    """How to reach the hosts and what to set up there before the launch."""

    launcher: str = "ssh"
    ssh_port: int | None = None
    launcher_args: str = ""
    venv_script: str | None = None
    cwd: str = field(default_factory=os.getcwd)
    exports: dict[str, str] = field(default_factory=dict)
    """Variables for the remote shell, already quoted as shell words."""


@dataclass(frozen=True)
class HostJob:
    """One host's part of the job: the command that starts it and the one that stops it."""

    host: str
    node_rank: int
    command: list[str]
    kill_command: list[str]


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines of a ``.deepspeed_env`` file; blank lines and ``#`` comments are skipped.

    Raises:
        ResourceError: naming the file and line for a line without ``=`` or with a bad name.
    """
    values: dict[str, str] = {}
    for number, raw in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, equals, value = line.partition("=")
        if not equals or not _ENV_KEY.match(key.strip()):
            raise ResourceError(f"{path}:{number}: expected KEY=VALUE with KEY a variable name, got {raw.strip()!r}")
        values[key.strip()] = value.strip()
    return values


def env_files(environ: Mapping[str, str], cwd: str, home: str) -> list[Path]:
    """DeepSpeed's ``.deepspeed_env`` lookup: the home directory first, then the working directory."""
    name = environ.get("DS_ENV_FILE", ".deepspeed_env")
    found: list[Path] = []
    for folder in (home, cwd):
        path = Path(folder, name)
        if path.is_file() and path.resolve() not in {p.resolve() for p in found}:
            found.append(path)
    return found


def _expandable(value: str) -> str:
    """Double-quoted for the remote shell: one word, ``$VAR`` still expanded (DeepSpeed's quoting)."""
    if re.search(r"[^\w@%+=:,./-]", value) is None:
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def forwarded_env(environ: Mapping[str, str], cwd: str, home: str) -> dict[str, str]:
    """The exports for every host, as shell words (see the module docstring for the rules)."""
    exports = {
        key: shlex.quote(value)
        for key, value in environ.items()
        if key.startswith(EXPORT_PREFIXES) and key not in LOCAL_ONLY and _ENV_KEY.match(key)
    }
    path = os.pathsep.join(p for p in (cwd, environ.get("PYTHONPATH", "")) if p)
    exports["PYTHONPATH"] = shlex.quote(path)
    for env_file in env_files(environ, cwd, home):
        exports.update({key: _expandable(value) for key, value in read_env_file(env_file).items()})
    return exports


def _ere_literal(text: str) -> str:
    """``text`` as a POSIX extended regex matching only itself (special characters in brackets)."""
    return "".join(f"[{c}]" if c in ".[]()*+?{}|^$\\" else c for c in text)


def host_jobs(
    hosts: Mapping[str, list[int]], launch_args: Sequence[str], script: Sequence[str], master: tuple[str, int],
    tag: str, remote: Remote,
) -> list[HostJob]:
    """One :class:`HostJob` per host, node ranks in ``hosts`` order.

    Args:
        hosts: active resources, ``{host: slot ids}``.
        launch_args: ``zeroshard launch`` options every host gets (torchrun options, ``--no_local_rank``).
        script: the script (or module) and its arguments.
        master: address and port of the static rendezvous.
        tag: the job's ``--rdzv_id``; the kill commands find the job's processes by it.
        remote: how to reach the hosts.
    """
    python = [sys.executable, "-u", "-m", "zeroshard.cli.main", "launch", "--rdzv_id", tag]
    # The pattern matches each host's launcher, never the kill command itself ("[-]-" is not "--").
    pattern = "zeroshard[.]cli[.]main launch [-]-rdzv_id " + _ere_literal(tag) + " [-]-node_rank "
    jobs = []
    for rank, (host, slots) in enumerate(hosts.items()):
        argv = [*python, "--node_rank", str(rank), "--nnodes", str(len(hosts)), "--nproc_per_node", str(len(slots)),
                "--master_addr", master[0], "--master_port", str(master[1]), *launch_args, *script]
        steps = [f"source {shlex.quote(remote.venv_script)}"] if remote.venv_script else []
        steps.append(f"cd {shlex.quote(remote.cwd)} || exit 1")
        exports = dict(remote.exports)
        devices = visible_devices(slots)
        if devices is not None:
            exports["CUDA_VISIBLE_DEVICES"] = devices
        steps += [f"export {key}={value}" for key, value in exports.items()]
        steps.append("exec " + shlex.join(argv))
        kill = f"pkill -TERM -f {shlex.quote(pattern + str(rank) + ' ')}"
        jobs.append(HostJob(host, rank, _reach(host, "; ".join(steps), remote), _reach(host, kill, remote)))
    return jobs


def _reach(host: str, command: str, remote: Remote) -> list[str]:
    extra = shlex.split(remote.launcher_args)
    if remote.launcher == "pdsh":
        return ["pdsh", "-S", "-f", str(PDSH_FAN_OUT), "-w", host, *extra, command]
    port = ["-p", str(remote.ssh_port)] if remote.ssh_port is not None else []
    return ["ssh", *port, *extra, host, command]


def launcher_env(environ: Mapping[str, str], remote: Remote) -> dict[str, str]:
    """The environment of the ssh/pdsh processes themselves (pdsh: use ssh, on ``--ssh_port``)."""
    env = dict(environ)
    if remote.launcher == "pdsh":
        env["PDSH_RCMD_TYPE"] = "ssh"
        if remote.ssh_port is not None:
            env["PDSH_SSH_ARGS_APPEND"] = f"{env.get('PDSH_SSH_ARGS_APPEND', '')} -p {remote.ssh_port}".strip()
    return env


def describe(jobs: Sequence[HostJob], remote: Remote) -> str:
    """The commands, one line per host, as ``--dry-run`` prints them."""
    prefix = "PDSH_RCMD_TYPE=ssh " if remote.launcher == "pdsh" else ""
    if remote.launcher == "pdsh" and remote.ssh_port is not None:
        prefix += f"PDSH_SSH_ARGS_APPEND='-p {remote.ssh_port}' "
    return "\n".join(f"{prefix}{shlex.join(job.command)}" for job in jobs)


class _Stopped(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def run(jobs: Sequence[HostJob], env: Mapping[str, str], prog: str, poll_s: float = 0.2) -> int:
    """Start every host's command; return 0 when all succeed, else the first failure's exit code
    after stopping the others. SIGINT/SIGTERM to the launcher stop every host."""
    def stop(signum: int, _frame: object) -> None:
        raise _Stopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    procs: list[subprocess.Popen] = []
    try:
        # Own sessions: a terminal's Ctrl-C reaches the launcher only, which then stops the hosts in order.
        procs = [subprocess.Popen(job.command, env=dict(env), stdin=subprocess.DEVNULL, start_new_session=True)
                 for job in jobs]
        while True:
            codes = [p.poll() for p in procs]
            failed = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
            if failed is not None:
                code = _exit_code(codes[failed])
                running = [i for i, c in enumerate(codes) if c is None]
                print(f"{prog}: host {jobs[failed].host} (node {failed}) exited with code {code}; stopping "
                      f"{len(running)} other host(s)", file=sys.stderr, flush=True)
                _teardown([jobs[i] for i in running], [procs[i] for i in running], env)
                return code
            if all(code == 0 for code in codes):
                return 0
            time.sleep(poll_s)
    except _Stopped as stopped:
        print(f"{prog}: stopped by signal {signal.Signals(stopped.signum).name}; stopping every host",
              file=sys.stderr, flush=True)
        running = [i for i, p in enumerate(procs) if p.poll() is None]
        _teardown([jobs[i] for i in running], [procs[i] for i in running], env)
        return 128 + stopped.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _exit_code(code: int | None) -> int:
    """A child killed by a signal (negative code) reads as a shell would: 128 + the signal."""
    return 1 if code is None else (128 - code if code < 0 else code)


def _teardown(jobs: Sequence[HostJob], procs: Sequence[subprocess.Popen], env: Mapping[str, str]) -> None:
    """Stop the hosts' remote processes (kill commands), then the local ssh/pdsh clients."""
    if not procs:
        return
    killers = [subprocess.Popen(job.kill_command, env=dict(env), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
               for job in jobs]
    _wait_all(killers, KILL_WAIT_S)
    for killer in killers:
        if killer.poll() is None:
            killer.kill()
            killer.wait()
    _wait_all(procs, GRACE_S)
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            try:
                os.killpg(p.pid, sig)  # the client and anything it started locally
            except ProcessLookupError:
                pass
        _wait_all(alive, wait_s)


def _wait_all(procs: Sequence[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
