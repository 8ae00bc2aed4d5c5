"""Where a checkpoint lives: tags, the ``latest`` file, completeness, and format detection.

A checkpoint root holds one directory per tag and a ``latest`` file naming the newest tag
(DeepSpeed's layout). A zeroshard tag directory is complete when it holds the completion marker,
which rank 0 writes last, after the metadata; directories without it (and ``.tmp-*`` leftovers of
an interrupted save) are refused with an error naming them. A DeepSpeed tag directory is
recognised by its ``*_model_states.pt`` / ``*_optim_states.pt`` files.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Literal

from zeroshard.checkpoint.atomic import OLD_PREFIX, TMP_PREFIX
from zeroshard.errors import CheckpointError

logger = logging.getLogger("zeroshard")

META_FILE = "zeroshard.json"
MARKER_FILE = "COMPLETE"
LATEST_FILE = "latest"

Format = Literal["zeroshard", "deepspeed"]


def marker_text(meta_bytes: bytes) -> str:
    """Content of the completion marker: the metadata's digest, so a marker cannot outlive it."""
    return f"sha256:{hashlib.sha256(meta_bytes).hexdigest()}\n"


def plain_name(name: object) -> bool:
    """Whether ``name`` is a plain, visible file name: no directory part, no leading dot, no NUL."""
    return isinstance(name, str) and bool(name) and not name.startswith(".") and not any(c in name for c in "/\\\0")


def plain_tag(tag: str) -> bool:
    """Whether ``tag`` can name a checkpoint directory: a plain name (``latest`` included, as in
    DeepSpeed; :mod:`zeroshard.checkpoint.save` keeps it from colliding with the ``latest`` file)."""
    return plain_name(tag)


def read_latest(root: Path) -> str | None:
    """The tag named by ``root/latest``, or ``None`` when there is no such file."""
    path = root / LATEST_FILE
    if not path.is_file():
        return None
    try:
        tag = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    if not tag:
        raise CheckpointError(f"{path} is empty; pass tag=... explicitly")
    if not plain_tag(tag) or tag == LATEST_FILE:  # a file cannot name itself: it is damaged
        raise CheckpointError(f"{path} names {tag!r}, which is not a checkpoint tag (a plain directory name); "
                              "the file is damaged, or pass tag=... explicitly")
    return tag


def _is_deepspeed(path: Path) -> bool:
    return any(path.glob("*_model_states.pt")) or any(path.glob("*_optim_states.pt"))


def _looks_like_checkpoint(path: Path) -> bool:
    return (path / META_FILE).exists() or (path / MARKER_FILE).exists() or _is_deepspeed(path)


def detect_format(path: Path) -> Format:
    """``"zeroshard"`` or ``"deepspeed"`` for a complete tag directory; raise otherwise."""
    if path.name.startswith(TMP_PREFIX):
        raise CheckpointError(f"{path} is an incomplete checkpoint (a save was interrupted before it was "
                              "published); it is never loaded")
    if (path / META_FILE).exists() or (path / MARKER_FILE).exists():
        marker, meta = path / MARKER_FILE, path / META_FILE
        if not marker.is_file() or not meta.is_file():
            raise CheckpointError(f"{path} is an incomplete zeroshard checkpoint (no {MARKER_FILE} marker: its save "
                                  "was interrupted); it is never loaded")
        try:
            intact = marker.read_bytes() == marker_text(meta.read_bytes()).encode()
        except OSError as e:
            raise CheckpointError(f"cannot read {path}: {e}") from e
        if not intact:
            raise CheckpointError(f"{meta} does not match the digest in {marker}: the checkpoint is corrupt")
        return "zeroshard"
    if _is_deepspeed(path):
        return "deepspeed"
    raise CheckpointError(f"{path} is not a checkpoint: it holds neither {META_FILE} (zeroshard) nor "
                          "*_model_states.pt files (DeepSpeed)")


def _available(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def resolve_checkpoint(root: str | Path, tag: str | None) -> Path | None:
    """The tag directory to load: ``root/tag``, or ``root/<latest>`` when ``tag`` is ``None``.

    ``tag="latest"`` is the directory ``root/latest`` when there is one (a checkpoint saved under
    that tag, as DeepSpeed allows), else the tag the ``latest`` file names (where DeepSpeed would
    load nothing). ``root`` may also be a tag directory itself (with ``tag=None``). Returns ``None`` when no tag
    is given and there is no ``latest`` file, or no ``root`` at all (DeepSpeed then starts from
    scratch). A tag whose
    directory was renamed aside by an interrupted replacement (``.old-<tag>-*``) is found there.

    Raises:
        CheckpointError: the directory is missing, incomplete, or not a checkpoint.
    """
    root = Path(root)
    if not root.is_dir():
        if tag is None and not root.exists():
            return None  # DeepSpeed: no latest file, nothing to resume
        if root.exists():
            raise CheckpointError(f"checkpoint directory {root} is a file: give the directory that "
                                  "save_checkpoint wrote (holding the 'latest' file and the tag directories)")
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    if tag is None:
        if _looks_like_checkpoint(root):
            detect_format(root)
            return root
        tag = read_latest(root)
        if tag is None:
            return None
    elif tag == LATEST_FILE and (root / LATEST_FILE).is_file():
        tag = read_latest(root)
    path = root / str(tag)
    if not path.is_dir():
        asides = sorted(root.glob(f"{OLD_PREFIX}{tag}-*"))
        for aside in asides:
            if (aside / MARKER_FILE).is_file():
                logger.warning("checkpoint %s: using %s, left by an interrupted replacement", path, aside)
                detect_format(aside)
                return aside
        partial = sorted(root.glob(f"{TMP_PREFIX}{tag}-*"))
        if partial:
            raise CheckpointError(f"checkpoint '{tag}' in {root} is incomplete: its save was interrupted "
                                  f"({partial[0]} was never published); load an earlier tag")
        raise CheckpointError(f"no checkpoint '{tag}' in {root} (tags there: {', '.join(_available(root)) or 'none'})")
    detect_format(path)
    return path
