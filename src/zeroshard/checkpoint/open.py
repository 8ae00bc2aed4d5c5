"""Opening a checkpoint tag in whichever format it is: zeroshard's or DeepSpeed's."""

from __future__ import annotations

from pathlib import Path

from zeroshard.checkpoint.deepspeed import DeepSpeedSource
from zeroshard.checkpoint.paths import detect_format
from zeroshard.checkpoint.source import CheckpointSource, ZeroshardSource

__all__ = ["open_source"]


def open_source(path: Path) -> CheckpointSource:
    """Open a complete tag directory in whichever format it is."""
    if detect_format(path) == "zeroshard":
        return ZeroshardSource(path)
    return DeepSpeedSource(path)
