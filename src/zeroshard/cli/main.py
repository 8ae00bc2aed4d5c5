"""Entry point of the ``zeroshard`` console script: ``zeroshard [--version] COMMAND [args...]``.

The top-level parser only knows ``--help``, ``--version`` and the command name. Everything after the
command name is handed, untouched, to that command's module, which is imported only then (so that
``zeroshard --version`` never imports torch).

Adding a subcommand takes one module and one line: write ``zeroshard/cli/<name>.py`` exposing
``main(argv: list[str], prog: str) -> int`` and add ``"<name>": ("zeroshard.cli.<name>", "help")``
to :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: command name -> (module implementing ``main(argv, prog) -> int``, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "launch": ("zeroshard.cli.launch", "run a training script on every local rank (wraps torchrun)"),
    "convert": ("zeroshard.cli.convert", "write a checkpoint's consolidated weights as safetensors"),
    "estimate": ("zeroshard.cli.estimate", "memory per GPU for ZeRO stages 0-3; write a config that fits"),
    "report": ("zeroshard.cli.report", "versions, accelerators, backends and optional features (like ds_report)"),
}


def package_version() -> str:
    """The installed version of zeroshard, or ``"unknown"`` when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("zeroshard")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    width = max(len(name) for name in COMMANDS)
    listing = "\n".join(f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="zeroshard",
        usage="%(prog)s [--version] [-h] COMMAND [args ...]",
        description="ZeRO sharded training for PyTorch with DeepSpeed-compatible configs.",
        epilog=f"commands:\n{listing}\n\n'%(prog)s COMMAND --help' describes a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    parser.add_argument("command", metavar="COMMAND", choices=sorted(COMMANDS), help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``zeroshard`` command line; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    # The first token that is not an option names the command; all later tokens belong to it.
    split = next((i for i, token in enumerate(args) if not token.startswith("-")), len(args))
    parsed = build_parser().parse_args(args[: split + 1])
    module = importlib.import_module(COMMANDS[parsed.command][0])
    code = module.main(args[split + 1 :], prog=f"zeroshard {parsed.command}")
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
