"""``accelerate launch`` on zeroshard: ``python -m zeroshard.deepspeed.accelerate_launch [--shadow] ARGS``.

``accelerate launch --use_deepspeed`` needs DeepSpeed twice: in the launcher process (it checks
that DeepSpeed is installed and imports ``deepspeed.launcher.runner``), and in every worker, where
accelerate and transformers drive it. On one machine (and on several with
``--deepspeed_multinode_launcher standard``) the launcher runs ``torch.distributed.run`` in its own
process, whose workers are fresh interpreters that run the script. This module takes exactly
``accelerate launch``'s arguments (parsed by accelerate's own parser), enables
:mod:`zeroshard.deepspeed.imports` here, and makes each worker run
``python -m zeroshard.deepspeed.imports [--shadow] SCRIPT ARGS`` (``-m MODULE`` with ``--module``),
which enables the layer before the script imports anything::

    python -m zeroshard.deepspeed.accelerate_launch --use_deepspeed --num_processes 2 --zero_stage 2 train.py

is ``accelerate launch --use_deepspeed --num_processes 2 --zero_stage 2 train.py`` on zeroshard.
``--shadow`` (first) hides a real DeepSpeed installed alongside, in the launcher and in the workers.

Not possible: ``--no_python`` (the layer runs in Python), and several machines with DeepSpeed's own
multi-node launchers (``pdsh``, ``openmpi``, ``mvapich``, ``slurm``, ``nossh``), which start the
``deepspeed`` executable on every host: zeroshard has none (``zeroshard launch --as-deepspeed`` takes
hostfiles instead).
"""

from __future__ import annotations

import sys

from zeroshard.deepspeed import imports as layer
from zeroshard.errors import ConfigError

_USAGE = ("usage: python -m zeroshard.deepspeed.accelerate_launch [--shadow] [ACCELERATE LAUNCH OPTIONS] "
          "SCRIPT [ARGS...]")


def main(argv: list[str] | None = None) -> int:
    """Enable the layer, then run ``accelerate launch`` with every worker under it."""
    args = list(sys.argv[1:] if argv is None else argv)
    shadow = bool(args) and args[0] == "--shadow"
    args = args[1:] if shadow else args
    if not args:
        print(_USAGE, file=sys.stderr)
        return 2
    layer.enable(shadow=shadow)  # before accelerate is imported: it checks for DeepSpeed at import
    try:
        from accelerate.commands.launch import launch_command, launch_command_parser
    except ImportError as e:
        raise ConfigError(f"accelerate's launcher is not importable ({e}): pip install 'zeroshard[hf]'",
                          key="accelerate") from e
    parsed = launch_command_parser().parse_args(args)
    if parsed.no_python:
        raise ConfigError("--no_python: the zeroshard.deepspeed.imports layer runs in Python; launch a Python "
                          "script or module", key="no_python")
    multinode_launcher = getattr(parsed, "deepspeed_multinode_launcher", None)
    if (parsed.num_machines or 1) > 1 and multinode_launcher != "standard":
        name = multinode_launcher or "pdsh (the default)"
        raise ConfigError(
            f"--deepspeed_multinode_launcher {name}: it starts the `deepspeed` executable on every "
            "host, which zeroshard does not provide; use --deepspeed_multinode_launcher standard (torchrun on "
            "each machine) or zeroshard launch --as-deepspeed with a hostfile", key="deepspeed_multinode_launcher")
    # Each worker runs `python -m zeroshard.deepspeed.imports [--shadow] [-m] SCRIPT ARGS`.
    parsed.training_script_args = [*(["--shadow"] if shadow else []), *(["-m"] if parsed.module else []),
                                   parsed.training_script, *parsed.training_script_args]
    parsed.training_script, parsed.module = layer.__name__, True
    launch_command(parsed)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as error:  # a usage error: the message, not a traceback
        print(f"zeroshard.deepspeed.accelerate_launch: error: {error}", file=sys.stderr)
        sys.exit(2)
