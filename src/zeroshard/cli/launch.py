"""``zeroshard launch``: start a training script on every local rank, with torch's own launcher.

``zeroshard launch [options] script.py [script args ...]`` translates its options into a
``torch.distributed.run`` (torchrun) command line and calls torchrun in-process; torchrun starts,
watches and restarts the worker processes. Each worker finds ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in its environment, which is what
``deepspeed.init_distributed()`` (and ``zeroshard.init_distributed()``) read.

Options, all before the script path (everything after it belongs to the script):

* ``--nproc_per_node N`` (alias ``--num_gpus``, as DeepSpeed's launcher), ``--nnodes N|MIN:MAX``
  (alias ``--num_nodes``), ``--node_rank``, ``--master_addr``, ``--master_port`` (default 29500
  once a master address is given, as DeepSpeed).
* Every other torchrun option (``--rdzv_backend``, ``--rdzv_endpoint``, ``--rdzv_id``,
  ``--rdzv_conf``, ``--standalone``, ``--max_restarts``, ``--monitor_interval``, ``--log_dir``,
  ``-m``/``--module``, ``--no_python``, ...) is passed through unchanged.

A single-node launch with no master address, port or rendezvous option uses torchrun's
``--standalone`` rendezvous, which listens on a free local port, so that two launches on one
machine never collide.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence

DEFAULT_MASTER_PORT = 29500
NPROC_KEYWORDS = ("auto", "cpu", "gpu", "xpu")

_NPROC = ("--nproc_per_node", "--nproc-per-node", "--num_gpus", "--num-gpus")
_NNODES = ("--nnodes", "--num_nodes", "--num-nodes")
_NODE_RANK = ("--node_rank", "--node-rank")
_MASTER_ADDR = ("--master_addr", "--master-addr")
_MASTER_PORT = ("--master_port", "--master-port")
_OWN_OPTIONS = frozenset((*_NPROC, *_NNODES, *_NODE_RANK, *_MASTER_ADDR, *_MASTER_PORT, "-h", "--help"))
_PASS_PREFIX = "torchrun__"


def _nproc_type(value: str) -> str:
    if value in NPROC_KEYWORDS:
        return value
    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer or one of {', '.join(NPROC_KEYWORDS)}, got {value!r}"
        ) from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return str(count)


def _parse_nnodes(value: str) -> tuple[int, int]:
    parts = value.split(":")
    try:
        numbers = [int(part) for part in parts]
    except ValueError:
        numbers = []
    if len(numbers) == 1:
        numbers = numbers * 2
    if len(numbers) != 2 or not 1 <= numbers[0] <= numbers[1]:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer N or a range MIN:MAX with 1 <= MIN <= MAX, got {value!r}"
        )
    return numbers[0], numbers[1]


def _nnodes_type(value: str) -> str:
    _parse_nnodes(value)
    return value


def _node_rank_type(value: str) -> int:
    try:
        rank = int(value)
    except ValueError:
        rank = -1
    if rank < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value!r}")
    return rank


def _port_type(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number between 1 and 65535, got {value!r}")
    return port


def _torchrun_actions() -> list[argparse.Action]:
    """torchrun's own options, minus those that ``zeroshard launch`` defines itself."""
    from torch.distributed.run import get_args_parser

    return [
        action
        for action in get_args_parser()._actions
        if action.option_strings and not _OWN_OPTIONS.intersection(action.option_strings)
    ]


def _canonical(option_strings: Sequence[str]) -> str:
    """The spelling used on the generated torchrun command line: ``--snake_case`` when there is one."""
    long = [s for s in option_strings if s.startswith("--")] or list(option_strings)
    return next((s for s in long if "_" in s), long[0])


def build_parser(prog: str = "zeroshard launch") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        usage="%(prog)s [options] script [script args ...]",
        description="Run a training script on every local rank, through torch.distributed.run "
        "(torchrun). Options go before the script path; everything after it is passed to the script.",
        allow_abbrev=False,
    )
    own = parser.add_argument_group("placement")
    own.add_argument(
        *_NPROC,
        dest="nproc_per_node",
        type=_nproc_type,
        metavar="N",
        help="processes per node (alias --num_gpus); also 'auto', 'cpu', 'gpu' or 'xpu' "
        "(default: torchrun's, 1)",
    )
    own.add_argument(
        *_NNODES, dest="nnodes", type=_nnodes_type, metavar="N|MIN:MAX", help="number of nodes (default 1)"
    )
    own.add_argument(*_NODE_RANK, dest="node_rank", type=_node_rank_type, metavar="RANK",
                     help="rank of this node, 0 .. nnodes-1 (default 0)")
    own.add_argument(*_MASTER_ADDR, dest="master_addr", metavar="HOST",
                     help="address of the node with node_rank 0; required for a multi-node static launch")
    own.add_argument(*_MASTER_PORT, dest="master_port", type=_port_type, metavar="PORT",
                     help=f"port on the master node (default {DEFAULT_MASTER_PORT} once --master_addr is "
                     "given; a free port for a single-node launch without --master_addr)")

    passthrough = parser.add_argument_group("torch.distributed.run options (passed through unchanged)")
    for action in _torchrun_actions():
        kwargs: dict = {
            "dest": _PASS_PREFIX + action.dest,
            "default": argparse.SUPPRESS,
            "help": (action.help or "").replace("%", "%%"),
        }
        if action.nargs == 0:
            passthrough.add_argument(*action.option_strings, action="store_true", **kwargs)
        else:
            if action.type in (int, float):
                kwargs["type"] = action.type
            passthrough.add_argument(
                *action.option_strings, choices=action.choices, metavar=action.dest.upper(), **kwargs
            )

    parser.add_argument("script", help="the training script (a module name with -m/--module)")
    remainder = parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    remainder.required = False  # Python < 3.12 marks a REMAINDER positional as required
    return parser


def build_torchrun_argv(argv: Sequence[str], prog: str = "zeroshard launch") -> list[str]:
    """Translate a ``zeroshard launch`` command line into a ``torch.distributed.run`` one.

    Raises ``SystemExit(2)`` with a message naming the offending argument on bad input.
    """
    parser = build_parser(prog)
    args = parser.parse_args(list(argv))
    passed = {
        name[len(_PASS_PREFIX):]: value for name, value in vars(args).items() if name.startswith(_PASS_PREFIX)
    }

    _, max_nodes = _parse_nnodes(args.nnodes or "1")
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

    actions = {action.dest: action for action in _torchrun_actions()}
    for dest, value in passed.items():
        option = _canonical(actions[dest].option_strings)
        if actions[dest].nargs == 0:
            if value:
                out.append(option)
        else:
            out += [option, str(value)]
    # "--" ends torchrun's options: its parser (allow_abbrev) would otherwise read the script's own
    # arguments too, and stop at one that abbreviates two of its options (``--max``, ``--log``).
    return [*out, "--", args.script, *args.script_args]


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
    """Launch; returns the exit code (that of the first failed worker, or 0)."""
    torchrun_argv, restarts = _own_restarts(build_torchrun_argv(argv, prog))
    code = 0
    for attempt in range(restarts + 1):
        if attempt:
            print(f"{prog}: the job failed (exit {code}); restarting it ({attempt} of {restarts})",
                  file=sys.stderr, flush=True)
        os.environ[ATTEMPT_ENV] = str(attempt)
        code = _run_once(torchrun_argv, prog)
        if code == 0 or code >= 128:  # done, or stopped by a signal: never restarted
            return code
    return code


def _run_once(torchrun_argv: list[str], prog: str) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun.main(torchrun_argv)
    except ChildFailedError as error:
        print(str(error), file=sys.stderr, flush=True)
        codes = [failure.exitcode for failure in error.failures.values()]
        return next((code for code in codes if code > 0), 1)
    except SignalException as error:
        print(f"{prog}: stopped by signal {error.sigval.name}", file=sys.stderr, flush=True)
        return 128 + int(error.sigval)
    except KeyboardInterrupt:
        return 130
    return 0
