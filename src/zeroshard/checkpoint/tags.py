"""Checkpoint tags at save time (DeepSpeed's rules) and the recovery script beside the checkpoints.

- :func:`agree_on_tag`: ``checkpoint.tag_validation`` (``Warn`` by default, ``Ignore``, ``Fail``)
  as ``DeepSpeedEngine._checkpoint_tag_validation``: ranks that pass different tags raise under
  ``Fail`` and log a warning under ``Warn``. DeepSpeed then lets each rank write into its own tag
  directory, which leaves no loadable checkpoint; zeroshard saves under rank 0's tag instead.
- :func:`check_tag`: any plain directory name is a tag, ``latest`` included (DeepSpeed accepts
  any string); a tag called ``latest`` cannot live beside the ``latest`` file that names the
  newest tag, so that case is refused before anything is written (DeepSpeed fails after writing).
- :func:`write_recovery_script`: the ``zero_to_fp32.py`` DeepSpeed leaves in every checkpoint
  folder, here a few lines that run :mod:`zeroshard.deepspeed.utils.zero_to_fp32`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path

import torch
import torch.distributed as dist

from zeroshard.checkpoint.atomic import write_file_atomic
from zeroshard.checkpoint.paths import LATEST_FILE, plain_tag
from zeroshard.core.comm import collectives as C
from zeroshard.errors import CheckpointError, TagMismatchError

logger = logging.getLogger("zeroshard")

def _script(name: str, usage: str, what: str) -> str:
    return f'''#!/usr/bin/env python
"""Consolidate the checkpoints in this folder into {what} weights (written by zeroshard, as DeepSpeed's).

    python {name}.py . OUTPUT_DIR {usage}[-t TAG] [--safe_serialization] [--max_shard_size 5GB]

The work is done by zeroshard.deepspeed.utils.{name}, which reads zeroshard and DeepSpeed checkpoints.
"""
import sys

from zeroshard.deepspeed.utils.{name} import *  # noqa: F401,F403  (DeepSpeed's functions, for importers)
from zeroshard.deepspeed.utils.{name} import main

if __name__ == "__main__":
    sys.exit(main())
'''


#: the scripts DeepSpeed 0.19.8 leaves in every checkpoint folder, by file name
SCRIPTS = {"zero_to_fp32.py": _script("zero_to_fp32", "", "fp32"),
           "zero_to_torch.py": _script("zero_to_torch", "--dtype bf16 ", "fp32, fp16 or bf16")}


def _digest(tag: str) -> int:
    return int.from_bytes(hashlib.sha1(tag.encode()).digest()[:8], "little", signed=True)


def agree_on_tag(tag: str, group: dist.ProcessGroup | None, mode: str) -> str:
    """The tag every rank saves under (collective): ``tag`` if all ranks agree, else rank 0's,
    after a warning (``WARN``), silently (``IGNORE``) or not at all (``FAIL`` raises on every rank)."""
    world = C.world_size(group)
    if world == 1:
        return tag
    device = C.control_device(group)
    digests = torch.empty(world, dtype=torch.int64, device=device)
    C.all_gather(digests, torch.tensor([_digest(tag)], dtype=torch.int64, device=device), group, async_op=False,
                 what="all-gather of checkpoint tags")
    differ = [r for r, d in enumerate(digests.tolist()) if d != int(digests[0])]
    if not differ:
        return tag
    message = (f"the checkpoint tag is not the same on all ranks (ranks {differ} differ from rank 0; this rank "
               f"has {tag!r}); a tag with rank-specific parts breaks restoring at another world size")
    if mode.upper() == "FAIL":
        raise TagMismatchError(f"{message}. checkpoint.tag_validation is 'Fail'")
    raw = torch.tensor(list(tag.encode()), dtype=torch.uint8, device=device)
    size = torch.tensor([raw.numel()], dtype=torch.int64, device=device)
    C.broadcast(size, src=0, group=group)
    buf = raw if C.rank(group) == 0 else torch.empty(int(size), dtype=torch.uint8, device=device)
    C.broadcast(buf, src=0, group=group)
    chosen = bytes(buf.cpu().tolist()).decode()
    if mode.upper() == "WARN":
        logger.warning("%s: saving under rank 0's tag %r (checkpoint.tag_validation 'Warn')", message, chosen)
    return chosen


def check_tag(tag: str, root: Path, save_latest: bool) -> str:
    """``tag`` if it can name a checkpoint directory in ``root``; raise otherwise."""
    if not plain_tag(tag):
        raise CheckpointError(f"invalid checkpoint tag {tag!r}: use a plain name such as 'global_step100' "
                              "(no '/', no leading '.')")
    if tag == LATEST_FILE and save_latest:
        raise CheckpointError(f"the tag {tag!r} with save_latest=True: the '{LATEST_FILE}' file that names the newest "
                              f"checkpoint would have to replace the checkpoint directory '{tag}'; pass "
                              "save_latest=False or choose another tag")
    if tag == LATEST_FILE and (root / LATEST_FILE).is_file():
        raise CheckpointError(f"{root / LATEST_FILE} is the file naming the newest checkpoint, so no checkpoint can be "
                              f"saved under the tag '{tag}' in {root}; choose another tag or directory")
    return tag


def write_recovery_script(root: Path) -> None:
    """Rank 0: ``root/zero_to_fp32.py`` and ``root/zero_to_torch.py``, executable, unless already there
    with this content."""
    for name, text in SCRIPTS.items():
        path = root / name
        try:
            if path.is_file() and path.read_text() == text:
                continue
            write_file_atomic(path, text.encode())
            os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        except OSError as e:  # the checkpoint is saved; the convenience scripts are not essential
            logger.warning("could not write %s: %s", path, e)
