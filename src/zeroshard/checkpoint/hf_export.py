"""A ``save_pretrained``-style directory from a sharded checkpoint: ``zeroshard convert --hf MODEL_DIR``.

Hugging Face's ``from_pretrained(OUT)`` reads ``config.json`` and the weights: one
``model.safetensors``, or shards ``model-00001-of-0000N.safetensors`` listed in
``model.safetensors.index.json`` when the weights exceed ``max_shard_size`` (Hugging Face's own
default, 50GB, unless given). The weights come from :func:`~zeroshard.checkpoint.consolidate.convert_checkpoint`,
which reads, casts and writes one tensor at a time, so memory stays near the largest tensor. The
model's small files (``config.json``, ``generation_config.json``, tokenizer files) are copied from
``MODEL_DIR``, which may be the Trainer's checkpoint directory itself (it holds ``config.json``);
``config.json``'s ``dtype`` is set to the dtype written, so the model loads in it.

Tensor names are the module's ``state_dict`` names as the engine saw them: a Hugging Face model
handed to ``initialize`` (or to the Trainer, or accelerate) gives exactly the names
``from_pretrained`` expects. Tied parameters are written once, as ``save_pretrained`` does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from zeroshard.checkpoint.consolidate import convert_checkpoint
from zeroshard.errors import CheckpointError

#: Hugging Face's ``save_pretrained`` default shard size.
DEFAULT_MAX_SHARD_SIZE = "50GB"
#: Small files of a model directory that ``from_pretrained`` or a tokenizer reads, copied when present.
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
               "tokenizer.model", "chat_template.jinja")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def config_dtype(model_dir: str | Path) -> torch.dtype | None:
    """The dtype ``MODEL_DIR/config.json`` declares (``dtype``, or the older ``torch_dtype``), if one we write."""
    config = _read_config(Path(model_dir))
    name = config.get("dtype", config.get("torch_dtype"))
    return {v: k for k, v in _DTYPE_NAMES.items()}.get(name) if isinstance(name, str) else None


def _read_config(model_dir: Path) -> dict[str, object]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist: --hf MODEL_DIR must be a Hugging Face model directory "
                              "(save_pretrained's output, or a Trainer checkpoint directory) holding config.json")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return config


def export_hf(model_dir: str | Path, checkpoint_dir: str | Path, out: str | Path, tag: str | None = None,
              dtype: torch.dtype | None = None, max_shard_size: str | int | None = None) -> list[Path]:
    """Write ``out`` as ``save_pretrained`` would for the checkpoint's weights; return the files written.

    Args:
        model_dir: directory holding the model's ``config.json`` (and optionally generation and tokenizer files).
        checkpoint_dir: a zeroshard or DeepSpeed checkpoint (the directory with ``latest``, or a tag directory).
        out: the output directory (created).
        tag: the checkpoint tag; default: the one ``latest`` names.
        dtype: dtype of floating-point weights; default: ``config.json``'s, else float32.
        max_shard_size: largest weights file (``"5GB"``); default Hugging Face's 50GB.

    Raises:
        CheckpointError: a missing or unreadable ``config.json``, a bad checkpoint, or ``out`` being a file.
    """
    model_dir, out = Path(model_dir), Path(out)
    config = _read_config(model_dir)
    dtype = dtype or config_dtype(model_dir) or torch.float32
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a directory")
    if out.suffix == ".safetensors":
        raise CheckpointError(f"{out}: --hf writes a model directory, not a .safetensors file")
    files = convert_checkpoint(checkpoint_dir, out, tag=tag, dtype=dtype,
                               max_shard_size=max_shard_size or DEFAULT_MAX_SHARD_SIZE)
    config["dtype"] = _DTYPE_NAMES[dtype]
    config.pop("torch_dtype", None)  # transformers 5 reads "dtype"; one key, so they cannot disagree
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    files.append(out / "config.json")
    for name in MODEL_FILES[1:]:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out / name)
            files.append(out / name)
    return files
