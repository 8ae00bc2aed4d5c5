"""The command line of ``zeroshard launch``: its own options, DeepSpeed's launcher options and
torchrun's options (passed through). Parsing only; ``launch.py`` acts on the result.

Options, all before the script path (everything after it belongs to the script):

* ``--nproc_per_node N`` (aliases ``--num_gpus``, ``--num_accelerators``, as DeepSpeed's launcher),
  ``--nnodes N|MIN:MAX`` (alias ``--num_nodes``), ``--node_rank``, ``--master_addr``,
  ``--master_port`` (default 29500 once a master address is given, as DeepSpeed).
* DeepSpeed's multi-node options: ``-H/--hostfile``, ``-i/--include``, ``-e/--exclude``,
  ``--launcher {pdsh,ssh}``, ``--launcher_args``, ``--ssh_port``, ``--force_multi``, ``--no_ssh``,
  ``--no_ssh_check``, ``--venv_script``, ``--no_local_rank``; and ``--dry-run``.
* ``--as-deepspeed`` (``--shadow-deepspeed``): run the script with ``zeroshard.deepspeed.imports``
  enabled (hiding an installed DeepSpeed), so ``import deepspeed`` in it, transformers or accelerate
  is zeroshard.
* Every other torchrun option (``--rdzv_backend``, ``--rdzv_endpoint``, ``--rdzv_id``,
  ``--rdzv_conf``, ``--standalone``, ``--max_restarts``, ``--monitor_interval``, ``--log_dir``,
  ``-m``/``--module``, ``--no_python``, ...) is passed through unchanged.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from zeroshard.cli.multinode import LAUNCHERS, UNSUPPORTED_LAUNCHERS

DEFAULT_MASTER_PORT = 29500
NPROC_KEYWORDS = ("auto", "cpu", "gpu", "xpu")

_NPROC = ("--nproc_per_node", "--nproc-per-node", "--num_gpus", "--num-gpus", "--num_accelerators",
          "--num-accelerators")
_NNODES = ("--nnodes", "--num_nodes", "--num-nodes")
_NODE_RANK = ("--node_rank", "--node-rank")
_MASTER_ADDR = ("--master_addr", "--master-addr")
_MASTER_PORT = ("--master_port", "--master-port")
#: DeepSpeed's launcher options (deepspeed/launcher/runner.py) that zeroshard launch implements.
_DEEPSPEED = (
    "-H", "--hostfile", "-i", "--include", "-e", "--exclude", "--launcher", "--launcher_args", "--ssh_port",
    "--force_multi", "--no_ssh", "--no_ssh_check", "--venv_script", "--no_local_rank", "--dry-run", "--dry_run",
    "--as-deepspeed", "--as_deepspeed", "--shadow-deepspeed", "--shadow_deepspeed", "--log_level", "--log-level",
    "-q", "--quiet",
)
#: DeepSpeed's ``--log_level`` choices (the launcher's own messages and torchrun's)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_OWN_OPTIONS = frozenset((*_NPROC, *_NNODES, *_NODE_RANK, *_MASTER_ADDR, *_MASTER_PORT, *_DEEPSPEED, "-h", "--help"))
PASS_PREFIX = "torchrun__"


def nproc_type(value: str) -> str:
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


def parse_nnodes(value: str) -> tuple[int, int]:
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
    parse_nnodes(value)
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


def _launcher_type(value: str) -> str:
    name = value.lower()
    if name in LAUNCHERS:
        return name
    if name in UNSUPPORTED_LAUNCHERS:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not supported by zeroshard launch (it starts hosts with {' or '.join(LAUNCHERS)}); "
            "under Slurm or MPI, run 'zeroshard launch --nnodes N --node_rank R --master_addr ...' once per node "
            "(docs/launching.md)"
        )
    raise argparse.ArgumentTypeError(f"expected one of {', '.join(LAUNCHERS)}, got {value!r}")


def torchrun_actions() -> list[argparse.Action]:
    """torchrun's own options, minus those that ``zeroshard launch`` defines itself."""
    from torch.distributed.run import get_args_parser

    return [
        action
        for action in get_args_parser()._actions
        if action.option_strings and not _OWN_OPTIONS.intersection(action.option_strings)
    ]


def canonical(option_strings: Sequence[str]) -> str:
    """The spelling used on the generated torchrun command line: ``--snake_case`` when there is one."""
    long = [s for s in option_strings if s.startswith("--")] or list(option_strings)
    return next((s for s in long if "_" in s), long[0])


def _add_placement(parser: argparse.ArgumentParser) -> None:
    own = parser.add_argument_group("placement")
    own.add_argument(*_NPROC, dest="nproc_per_node", type=nproc_type, metavar="N",
                     help="processes per node (aliases --num_gpus, --num_accelerators); also 'auto', 'cpu', "
                     "'gpu' or 'xpu' (default: torchrun's, 1); with a hostfile: slots 0..N-1 of every host")
    own.add_argument(*_NNODES, dest="nnodes", type=_nnodes_type, metavar="N|MIN:MAX",
                     help="number of nodes (default 1); with a hostfile: its first N hosts")
    own.add_argument(*_NODE_RANK, dest="node_rank", type=_node_rank_type, metavar="RANK",
                     help="rank of this node, 0 .. nnodes-1 (default 0)")
    own.add_argument(*_MASTER_ADDR, dest="master_addr", metavar="HOST",
                     help="address of the node with node_rank 0; required for a multi-node static launch "
                     "(with a hostfile: default its first host)")
    own.add_argument(*_MASTER_PORT, dest="master_port", type=_port_type, metavar="PORT",
                     help=f"port on the master node (default {DEFAULT_MASTER_PORT} once --master_addr is "
                     "given; a free port for a single-node launch without --master_addr)")


def _add_deepspeed(parser: argparse.ArgumentParser) -> None:
    ds = parser.add_argument_group("several machines (DeepSpeed's launcher options)")
    ds.add_argument("-H", "--hostfile", metavar="FILE",
                    help="lines 'HOST slots=N': the machines of the job; with several, one torchrun per host is "
                    "started over ssh/pdsh (DeepSpeed's implicit /job/hostfile is not read)")
    ds.add_argument("-i", "--include", default="", metavar="SPEC",
                    help="hosts and slots to use, e.g. 'worker-0@worker-1:0,2'")
    ds.add_argument("-e", "--exclude", default="", metavar="SPEC",
                    help="hosts and slots not to use, e.g. 'worker-1:0'")
    ds.add_argument("--launcher", type=_launcher_type, metavar="{pdsh,ssh}",
                    help="how hosts are started (default: pdsh when installed, else ssh)")
    ds.add_argument("--launcher_args", default="", metavar="ARGS",
                    help="extra arguments for ssh/pdsh, as one quoted string")
    ds.add_argument("--ssh_port", type=_port_type, metavar="PORT", help="ssh port of the hosts")
    ds.add_argument("--force_multi", action="store_true",
                    help="start the job over ssh/pdsh even when the hostfile leaves one host")
    ds.add_argument("--no_ssh", action="store_true",
                    help="launch this node only (its --node_rank in the hostfile); run the same command on every node")
    ds.add_argument("--no_ssh_check", action="store_true",
                    help="accepted for DeepSpeed compatibility (zeroshard does not probe ssh first)")
    ds.add_argument("--venv_script", metavar="FILE", help="sourced on every host before the launch")
    ds.add_argument("--no_local_rank", action="store_true",
                    help="never pass --local_rank=N to the script (by default it is passed when the script's "
                    "source mentions --local_rank or --local-rank)")
    ds.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                    help="print the commands (per host, or the torchrun command) and exit")
    ds.add_argument("--as-deepspeed", "--as_deepspeed", dest="as_deepspeed", action="store_true",
                    help="run the script with zeroshard.deepspeed.imports enabled: 'import deepspeed' (in it, "
                    "transformers or accelerate) is zeroshard; refused when the real DeepSpeed is installed")
    ds.add_argument("--shadow-deepspeed", "--shadow_deepspeed", dest="shadow_deepspeed", action="store_true",
                    help="--as-deepspeed, hiding the real DeepSpeed installed in the same environment")
    ds.add_argument("--log_level", "--log-level", choices=LOG_LEVELS, default=None,
                    help="messages shown of the launcher (default info) and of torchrun's internals (default "
                    "warning, or the LOGLEVEL variable, torchrun's own switch); not the workers' own")
    ds.add_argument("-q", "--quiet", dest="log_level", action="store_const", const="error",
                    help="--log_level error")


#: DeepSpeed launcher options zeroshard launch does not have: option -> why, and what to use instead
_BIND = "binding each rank to CPU cores is not supported; bind them with numactl or taskset"
REFUSED = {
    "--bind_cores_to_rank": _BIND,
    "--bind_core_list": _BIND,
    "--autotuning": "autotuning is not supported",
    "--enable_each_rank_log": "use torchrun's --log-dir with --redirects or --tee (passed through)",
    "--save_pid": "the launcher's pid file is not written; torchrun's process is this command's",
}


class _Refused(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"argument {option_string}: DeepSpeed's launcher option is not supported by zeroshard launch: "
                     f"{REFUSED[self.option_strings[0]]}")


def build_parser(prog: str = "zeroshard launch") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        usage="%(prog)s [options] script [script args ...]",
        description="Run a training script on every local rank, through torch.distributed.run "
        "(torchrun), or on several machines from a hostfile. Options go before the script path; everything "
        "after it is passed to the script.",
        allow_abbrev=False,
    )
    _add_placement(parser)
    _add_deepspeed(parser)
    refused = parser.add_argument_group("DeepSpeed launcher options that are refused, naming why")
    for option in REFUSED:
        refused.add_argument(option, nargs="?", action=_Refused, help=argparse.SUPPRESS)
    passthrough = parser.add_argument_group("torch.distributed.run options (passed through unchanged)")
    for action in torchrun_actions():
        kwargs: dict = {
            "dest": PASS_PREFIX + action.dest,
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


def passed_options(args: argparse.Namespace) -> dict:
    """The torchrun options given on the command line, by torchrun's ``dest``."""
    return {name[len(PASS_PREFIX):]: value for name, value in vars(args).items() if name.startswith(PASS_PREFIX)}


def torchrun_option_args(passed: dict) -> list[str]:
    """``passed`` back as command-line arguments, in torchrun's canonical spelling."""
    actions = {action.dest: action for action in torchrun_actions()}
    out: list[str] = []
    for dest, value in passed.items():
        option = canonical(actions[dest].option_strings)
        if actions[dest].nargs == 0:
            if value:
                out.append(option)
        else:
            out += [option, str(value)]
    return out
