"""``zeroshard launch``: start a training script on every rank, with torch's own launcher.

``zeroshard launch [options] script.py [script args ...]`` translates its options
(``launch_args.py``) into a ``torch.distributed.run`` (torchrun) command line and calls torchrun
in-process; torchrun starts, watches and restarts the worker processes. Each worker finds
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in its environment,
which is what ``deepspeed.init_distributed()`` (and ``zeroshard.init_distributed()``) read.

Where the job runs:

* no hostfile: this node. Without a master address, port or rendezvous option, and one node,
  torchrun's ``--standalone`` rendezvous listens on a free local port, so that two launches on
  one machine never collide. ``--nnodes N --node_rank R --master_addr A`` on every node is a
  multi-node job with torchrun's static rendezvous ("the same command on every node", and Slurm).
* ``--hostfile`` (``hostfile.py``; filtered by ``--include``/``--exclude``, ``--num_nodes``,
  ``--num_gpus``): several hosts are started over ssh or pdsh (``multinode.py``); one host (and no
  ``--force_multi``) runs here with its slots; with ``--node_rank`` (``--no_ssh``) only that node
  of the hostfile runs here.

``--local_rank``: as DeepSpeed's launcher, the script gets ``--local_rank=<local rank>`` before
its own arguments, but only when its source mentions ``--local_rank`` or ``--local-rank`` (a
script that declares the option) or fires a function with a ``local_rank`` parameter through
Python Fire, so scripts that read ``LOCAL_RANK`` from the environment and
reject unknown arguments keep working; ``--no_local_rank`` never passes it, and modules (``-m``)
and ``--no_python`` commands never get it. The value comes from torchrun's ``${local_rank}``
substitution in worker arguments.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import re
import shlex
import shutil
import signal
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from zeroshard.cli import multinode
from zeroshard.cli.hostfile import ResourceError, filter_resources, limit_resources, read_hostfile, visible_devices
from zeroshard.cli.launch_args import (
    DEFAULT_MASTER_PORT,
    NPROC_KEYWORDS,
    build_parser,
    parse_nnodes,
    passed_options,
    torchrun_option_args,
)
from zeroshard.cli.launch_args import torchrun_actions as _torchrun_actions  # noqa: F401 (tests use it)

__all__ = ["ATTEMPT_ENV", "DEFAULT_MASTER_PORT", "NPROC_KEYWORDS", "build_parser", "build_torchrun_argv", "main"]

#: torchrun replaces ``${local_rank}`` in every worker argument with that worker's local rank.
LOCAL_RANK_ARG = "--local_rank=${local_rank}"
_DECLARES_LOCAL_RANK = re.compile(r"--local[_-]rank")
#: a Python Fire script (HelloDeepSpeed's ``train_bert_ds.py``): every parameter of the function it
#: fires is an option, so a ``local_rank`` parameter declares ``--local_rank``
_FIRE = re.compile(r"^\s*(import fire|from fire import)", re.MULTILINE)
_FIRE_LOCAL_RANK = re.compile(r"\bdef\s+\w+\s*\([^)]*\blocal_rank\b")


def build_torchrun_argv(argv: Sequence[str], prog: str = "zeroshard launch") -> list[str]:
    """Translate a single-node ``zeroshard launch`` command line into a ``torch.distributed.run`` one.

    Raises ``SystemExit(2)`` with a message naming the offending argument on bad input, or when a
    hostfile asks for several hosts (those are started by :func:`main`).
    """
    parser = build_parser(prog)
    args = parser.parse_args(list(argv))
    hosts = _resolve_hosts(parser, args)
    if hosts is not None and _runs_remotely(args, hosts):
        parser.error(f"argument --hostfile: {len(hosts)} hosts: a multi-host launch, not one torchrun command")
    return _translate(parser, args, passed_options(args), hosts)[0]


def _resolve_hosts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, list[int]] | None:
    """The active ``{host: slots}`` of a hostfile (or of this machine's accelerators, for a bare
    ``--include``/``--exclude``), or ``None`` when the job is placed by torchrun's options alone."""
    filters = args.include or args.exclude
    if args.hostfile is None and not filters:
        for flag in ("no_ssh", "force_multi"):
            if getattr(args, flag):
                parser.error(f"argument --{flag}: needs a --hostfile")
        return None
    if filters and (args.nnodes is not None or args.nproc_per_node is not None):
        parser.error("argument --include/--exclude: not allowed with --num_nodes/--num_gpus (as in DeepSpeed)")
    try:
        pool = read_hostfile(args.hostfile) if args.hostfile else {"localhost": _accelerator_count(parser)}
        active = filter_resources(pool, args.include, args.exclude)
        return limit_resources(active, _count(parser, args.nnodes, "--num_nodes"),
                               _count(parser, args.nproc_per_node, "--num_gpus"))
    except ResourceError as error:
        parser.error(str(error))


def _count(parser: argparse.ArgumentParser, value: str | None, option: str) -> int | None:
    if value is not None and not value.isdigit():
        parser.error(f"argument {option}: with a hostfile, expected a positive integer, got {value!r}")
    return None if value is None else int(value)


def _visible_accelerators() -> int:
    import torch

    return int(torch.accelerator.device_count() if hasattr(torch, "accelerator") else torch.cuda.device_count())


def _accelerator_count(parser: argparse.ArgumentParser) -> int:
    count = _visible_accelerators()
    if count == 0:
        parser.error("argument --include/--exclude: no --hostfile, and this machine has no accelerators to select")
    return count


def _one_per_accelerator(say: bool) -> str | None:
    """No process count given: one per visible accelerator, as ``deepspeed script.py`` starts (torchrun
    would start one); ``None`` on a machine without (torchrun's default, one process)."""
    count = _visible_accelerators()
    if count == 0:
        return None
    if say:  # not under --quiet
        print(f"zeroshard launch: {count} processes, one per visible accelerator (--num_gpus N to choose)",
              file=sys.stderr)
    return str(count)


def _runs_remotely(args: argparse.Namespace, hosts: dict[str, list[int]]) -> bool:
    return (len(hosts) > 1 or args.force_multi) and not args.no_ssh and args.node_rank is None


def _place_from_hosts(parser: argparse.ArgumentParser, args: argparse.Namespace,
                      hosts: dict[str, list[int]]) -> dict[str, str]:
    """Set this node's nproc/nnodes/master from ``hosts``; returns the environment it needs."""
    if args.no_ssh and args.node_rank is None:
        parser.error("argument --no_ssh: needs --node_rank (this node's line in the hostfile, from 0)")
    rank = args.node_rank or 0
    if rank >= len(hosts):
        parser.error(f"argument --node_rank: the hostfile leaves {len(hosts)} hosts, got {rank}")
    slots = list(hosts.values())[rank]
    args.nproc_per_node, args.nnodes = str(len(slots)), str(len(hosts))
    if len(hosts) > 1:
        args.node_rank = rank
        args.master_addr = args.master_addr or next(iter(hosts))
    devices = visible_devices(slots)
    return {} if devices is None else {"CUDA_VISIBLE_DEVICES": devices}


def _translate(parser: argparse.ArgumentParser, args: argparse.Namespace, passed: dict,
               hosts: dict[str, list[int]] | None) -> tuple[list[str], dict[str, str]]:
    """The torchrun argv for this node, and the environment variables it needs."""
    env = _place_from_hosts(parser, args, hosts) if hosts is not None else {}
    _, max_nodes = parse_nnodes(args.nnodes or "1")
    rendezvous_given = bool(
        passed.get("standalone")
        or "rdzv_endpoint" in passed
        or passed.get("rdzv_backend", "static") != "static"
    )
    if args.node_rank is not None and not rendezvous_given and args.node_rank >= max_nodes:
        parser.error(
            f"argument --node_rank: must be smaller than --nnodes ({max_nodes}), got {args.node_rank}"
        )
    if passed.get("module") and passed.get("no_python"):
        parser.error("argument --module: not allowed together with --no_python")
    _check_script(parser, args.script, passed)

    out: list[str] = []
    if args.nproc_per_node is None:
        args.nproc_per_node = _one_per_accelerator(say=args.log_level in (None, "debug", "info"))
    if args.nproc_per_node is not None:
        out += ["--nproc_per_node", args.nproc_per_node]
    if args.nnodes is not None:
        out += ["--nnodes", args.nnodes]
    if args.node_rank is not None:
        out += ["--node_rank", str(args.node_rank)]
    if args.master_addr is not None or args.master_port is not None:
        if args.master_addr is not None:
            out += ["--master_addr", args.master_addr]
        out += ["--master_port", str(args.master_port or DEFAULT_MASTER_PORT)]
    elif not rendezvous_given:
        if max_nodes > 1:
            parser.error(
                "argument --master_addr: required when more than one node may join "
                f"(--nnodes {args.nnodes}), unless a rendezvous is given with --rdzv_endpoint"
            )
        out.append("--standalone")
    out += torchrun_option_args(passed)
    env.update(_worker_env(args))
    local_rank = [LOCAL_RANK_ARG] if _wants_local_rank(args, passed) else []
    target = [args.script, *local_rank, *args.script_args]
    if args.as_deepspeed or args.shadow_deepspeed:
        out, target = _as_deepspeed(parser, args, passed, out, target)
    # "--" ends torchrun's options: its parser (allow_abbrev) would otherwise read the script's own
    # arguments too, and stop at one that abbreviates two of its options (``--max``, ``--log``).
    return [*out, "--", *target], env


def _worker_env(args: argparse.Namespace) -> dict[str, str]:
    """What DeepSpeed's launcher sets in every worker beyond torchrun's variables: ``LOCAL_SIZE``
    (processes on this node), ``CROSS_RANK`` (this node's rank) and ``CROSS_SIZE`` (nodes), for a
    fixed placement; and ``OMP_NUM_THREADS``, unless set, to this machine's cores divided among its
    processes (torchrun would set 1, which starves CPU work; DeepSpeed leaves it unset, and every
    rank then starts a thread per core)."""
    env: dict[str, str] = {}
    nproc = args.nproc_per_node
    if nproc is None or not str(nproc).isdigit():  # "auto", "gpu": counted by torchrun
        return env
    env["LOCAL_SIZE"] = str(nproc)
    min_nodes, max_nodes = parse_nnodes(args.nnodes or "1")
    if min_nodes == max_nodes:
        env["CROSS_RANK"], env["CROSS_SIZE"] = str(args.node_rank or 0), str(max_nodes)
    if "OMP_NUM_THREADS" not in os.environ and int(nproc) > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        env["OMP_NUM_THREADS"] = str(max(1, cores // int(nproc)))
    return env


#: The module that enables the DeepSpeed compatibility layer, then runs a script or module (runpy).
COMPAT_BOOTSTRAP = "zeroshard.deepspeed.imports"


def _as_deepspeed(parser: argparse.ArgumentParser, args: argparse.Namespace, passed: dict, out: list[str],
                  target: list[str]) -> tuple[list[str], list[str]]:
    """``--as-deepspeed``: every worker runs ``python -m zeroshard.deepspeed.imports [--shadow] [-m] TARGET``,
    which enables the layer before the script (and transformers or accelerate) is imported."""
    if passed.get("no_python"):
        parser.error("argument --as-deepspeed: not allowed together with --no_python (the layer runs in Python)")
    layer = [COMPAT_BOOTSTRAP, *(["--shadow"] if args.shadow_deepspeed else [])]
    if passed.get("module"):
        return out, [*layer, "-m", *target]
    return [*out, "--module"], [*layer, *target]


def _wants_local_rank(args: argparse.Namespace, passed: dict) -> bool:
    """DeepSpeed passes ``--local_rank`` to every script; here only to scripts that declare it."""
    if args.no_local_rank or passed.get("module") or passed.get("no_python"):
        return False
    try:
        source = Path(args.script).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    if _DECLARES_LOCAL_RANK.search(source) is not None:
        return True
    return _FIRE.search(source) is not None and _FIRE_LOCAL_RANK.search(source) is not None


def _check_script(parser: argparse.ArgumentParser, script: str, passed: dict) -> None:
    if passed.get("module"):
        return  # a module name, resolved by the worker's Python
    if passed.get("no_python"):
        if not (os.path.exists(script) or shutil.which(script)):
            parser.error(f"argument script: no such file or command: {script!r}")
        return
    if not os.path.isfile(script):
        what = "is a directory, not a file" if os.path.isdir(script) else "no such file"
        parser.error(f"argument script: {what}: {script!r}")


def _multi_host(parser: argparse.ArgumentParser, args: argparse.Namespace, hosts: dict[str, list[int]],
                prog: str) -> int:
    """Start (or with ``--dry-run`` print) one ``zeroshard launch`` per host."""
    passed = passed_options(args)
    if passed.get("standalone"):
        parser.error("argument --standalone: a single-node rendezvous; not with a hostfile of several hosts")
    if passed.get("module") and passed.get("no_python"):
        parser.error("argument --module: not allowed together with --no_python")
    _check_script(parser, args.script, passed)
    tag = str(passed.pop("rdzv_id", None) or f"zeroshard-{uuid.uuid4().hex[:12]}")
    launcher = args.launcher or ("pdsh" if shutil.which("pdsh") else "ssh")
    cwd = os.getcwd()
    try:
        exports = multinode.forwarded_env(os.environ, cwd, os.path.expanduser("~"))
    except ResourceError as error:
        parser.error(str(error))
    remote = multinode.Remote(launcher, args.ssh_port, args.launcher_args, args.venv_script, cwd, exports)
    master = (args.master_addr or next(iter(hosts)), args.master_port or DEFAULT_MASTER_PORT)
    launch_args = torchrun_option_args(passed) + (["--no_local_rank"] if args.no_local_rank else [])
    launch_args += ["--as-deepspeed"] if args.as_deepspeed else []
    launch_args += ["--shadow-deepspeed"] if args.shadow_deepspeed else []
    launch_args += ["--log_level", args.log_level] if args.log_level is not None else []
    jobs = multinode.host_jobs(hosts, launch_args, [args.script, *args.script_args], master, tag, remote)
    if args.dry_run:
        print(multinode.describe(jobs, remote), flush=True)
        return 0
    if shutil.which(launcher) is None:
        parser.error(f"argument --launcher: {launcher!r} is not installed (no {launcher} on PATH)")
    return multinode.run(jobs, multinode.launcher_env(os.environ, remote), prog)


#: Set in the workers' environment: 0 on the first launch, k on the k-th restart (both ways).
ATTEMPT_ENV = "ZEROSHARD_LAUNCH_ATTEMPT"


def _own_restarts(torchrun_argv: list[str]) -> tuple[list[str], int]:
    """Single-node standalone jobs restart by relaunching torchrun (a fresh rendezvous and store):
    torchrun's in-place restart of gloo workers sometimes reads the dead workers' addresses
    (``Gloo connectFullMesh failed ... Connection refused``; seen with torch 2.13 on one host in
    3 of 4 tries). Returns the argv without ``--max_restarts`` and the restart count; other jobs
    keep torchrun's elastic restarts (``0`` here)."""
    options = torchrun_argv[: torchrun_argv.index("--")]
    if "--standalone" not in options or "--max_restarts" not in options:
        return torchrun_argv, 0
    i = options.index("--max_restarts")
    return torchrun_argv[:i] + torchrun_argv[i + 2 :], int(torchrun_argv[i + 1])


def main(argv: Sequence[str], prog: str = "zeroshard launch") -> int:
    """Launch; returns the exit code (that of the first failed worker or host, or 0)."""
    parser = build_parser(prog)
    args = parser.parse_args(list(argv))
    _set_log_level(args.log_level)
    if args.as_deepspeed and not args.shadow_deepspeed:
        real = importlib.util.find_spec("deepspeed")
        if real is not None:  # every worker would refuse it, each with a traceback
            parser.error(f"argument --as-deepspeed: the real DeepSpeed is installed here ({real.origin}) and the "
                         "layer would hide it; use --shadow-deepspeed to run zeroshard in its place, or uninstall "
                         "deepspeed")
    hosts = _resolve_hosts(parser, args)
    if hosts is not None and _runs_remotely(args, hosts):
        return _multi_host(parser, args, hosts, prog)
    torchrun_argv, env = _translate(parser, args, passed_options(args), hosts)
    if args.dry_run:
        command = [sys.executable, "-m", "torch.distributed.run", *torchrun_argv]
        print(" ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(command)]), flush=True)
        return 0
    os.environ.update(env)
    torchrun_argv, restarts = _own_restarts(torchrun_argv)
    code = 0
    for attempt in range(restarts + 1):
        if attempt:
            print(f"{prog}: the job failed (exit {code}); restarting it ({attempt} of {restarts})",
                  file=sys.stderr, flush=True)
        os.environ[ATTEMPT_ENV] = str(attempt)
        code, stopped = _run_once(torchrun_argv, prog)
        if code == 0 or stopped:  # done, or this command was stopped by a signal: never restarted
            return code
    return code


def _set_log_level(name: str | None) -> None:
    """``--log_level``: this command's messages and torchrun's (its logger is ``torch.distributed``).

    Unset, this command's own messages are shown from ``info`` up, as DeepSpeed's launcher's, and
    torchrun's internals (rendezvous rounds, signal handlers, log directories: a dozen lines before the
    first of the job's) from ``warning`` up, or at the level its own ``LOGLEVEL`` variable names."""
    ours = getattr(logging, (name or "info").upper())
    torchrun_level = name or os.environ.get("LOGLEVEL", "warning")
    theirs = getattr(logging, torchrun_level.upper(), None)
    if not isinstance(theirs, int):
        theirs = logging.WARNING  # LOGLEVEL holds something torchrun would refuse too: keep the default
    logging.getLogger("zeroshard").setLevel(ours)
    logging.getLogger("torch.distributed").setLevel(theirs)


def _exit_code(code: int) -> int:
    """A worker's exit status as this command's: a worker killed by a signal (negative in torchrun's
    report; the OOM killer's SIGKILL) gives 128 + the signal, as a shell reports it."""
    return 128 - code if code < 0 else code


def _continue_stopped_workers() -> None:
    """torchrun ends a failed job by signalling each worker's process group (SIGTERM), then waits
    30 s before SIGKILL. A stopped worker (SIGSTOP, a debugger, a frozen cgroup) holds the SIGTERM
    pending until it is continued, so a job with one ended 30 s late. In this launcher process
    only, send SIGCONT after torchrun's signal, so that a stopped worker acts on it at once; a
    running one ignores SIGCONT. Left as it is where torch's handler is not the one expected."""
    from torch.distributed.elastic.multiprocessing import subprocess_handler

    handler = getattr(subprocess_handler, "SubprocessHandler", None)
    close = getattr(handler, "close", None)
    if os.name != "posix" or close is None or getattr(close, "continues_stopped", False):
        return

    def close_and_continue(self: object, death_sig: signal.Signals | None = None) -> None:
        close(self, death_sig)
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)  # type: ignore[attr-defined]
        except (OSError, AttributeError):  # already gone, or not a group leader
            pass

    close_and_continue.continues_stopped = True  # type: ignore[attr-defined]
    handler.close = close_and_continue  # type: ignore[union-attr]


def _run_once(torchrun_argv: list[str], prog: str) -> tuple[int, bool]:
    """Run torchrun once: the exit code, and whether this command itself was stopped by a signal."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    _continue_stopped_workers()
    try:
        torchrun.main(torchrun_argv)
    except ChildFailedError as error:
        print(str(error), file=sys.stderr, flush=True)
        codes = [_exit_code(failure.exitcode) for failure in error.failures.values()]
        return next((code for code in codes if code > 0), 1), False
    except SignalException as error:
        print(f"{prog}: stopped by signal {error.sigval.name}", file=sys.stderr, flush=True)
        return 128 + int(error.sigval), True
    except KeyboardInterrupt:
        return 130, True
    return 0, False
