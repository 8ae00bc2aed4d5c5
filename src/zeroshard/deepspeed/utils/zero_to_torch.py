"""DeepSpeed's ``zero_to_torch``: a ZeRO checkpoint consolidated into fp32, fp16 or bf16 weights.

``python -m zeroshard.deepspeed.utils.zero_to_torch CHECKPOINT_DIR OUTPUT_DIR --dtype {fp32,fp16,bf16,...}``, with
the flags of :mod:`zeroshard.deepspeed.utils.zero_to_fp32` (``-t TAG``, ``--safe_serialization``,
``--max_shard_size``, ``--exclude_frozen_parameters``), for zeroshard and DeepSpeed checkpoints.
Floating-point tensors are cast to ``--dtype``, others keep theirs. Every saved checkpoint folder
holds a ``zero_to_torch.py`` that runs this module, as DeepSpeed's do.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from zeroshard.deepspeed.utils import zero_to_fp32

__all__ = ["main", "zero_to_fp32"]


def main(argv: Sequence[str] | None = None, prog: str = "zero_to_torch.py") -> int:
    """Run the command; returns the exit code (2 for a bad checkpoint or argument)."""
    return zero_to_fp32.main(argv, prog, with_dtype=True)


if __name__ == "__main__":
    sys.exit(main(prog="python -m zeroshard.deepspeed.utils.zero_to_torch"))
