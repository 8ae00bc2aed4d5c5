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
import logging
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from zeroshard.checkpoint.consolidate import _names, _open, convert_checkpoint
from zeroshard.errors import CheckpointError

logger = logging.getLogger(__name__)

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
        CheckpointError: a missing or unreadable ``config.json``, a bad checkpoint, ``out`` being a file,
            or tensor names that are not the weights of ``config.json``'s architecture.
    """
    model_dir, out = Path(model_dir), Path(out)
    config = _read_config(model_dir)
    dtype = dtype or config_dtype(model_dir) or torch.float32
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a directory")
    if out.suffix == ".safetensors":
        raise CheckpointError(f"{out}: --hf writes a model directory, not a .safetensors file")
    with _open(checkpoint_dir, tag) as src:
        names = _names(src)
    check_names_fit_config(model_dir, names, checkpoint_dir)
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


#: Heads tried, in order, for a config.json that names no architecture (``config.save_pretrained`` alone).
_AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModel", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM",
                 "AutoModelForSequenceClassification", "AutoModelForTokenClassification")


def _candidates(model_dir: Path) -> list[tuple[str, list[set[str]], set[str], str]]:
    """For each model class ``config.json`` may describe: its name, one set of names per parameter
    (tied names together), every ``state_dict`` name and the base-model prefix. Empty when
    transformers is absent or cannot build the config (custom code), so nothing can be checked."""
    try:
        import transformers
    except ImportError:
        return []
    try:
        config = transformers.AutoConfig.from_pretrained(model_dir)
    except Exception as e:  # a config this transformers cannot read is not ours to judge
        logger.info("not checking tensor names against %s: %s", model_dir, e)
        return []
    named = [getattr(transformers, a, None) for a in (getattr(config, "architectures", None) or [])[:1]]
    builders = [c for c in named if c is not None] or [getattr(transformers, a).from_config for a in _AUTO_CLASSES]
    found = []
    for build in builders:
        try:
            with torch.device("meta"):  # names and ties only: no memory, no initialisation
                model = build(config)
        except Exception:  # this head does not exist for the model type
            continue
        tied: dict[int, set[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            tied.setdefault(id(param), set()).add(name)
        found.append((type(model).__name__, list(tied.values()), set(model.state_dict()),
                      getattr(model, "base_model_prefix", "") or ""))
    return found


def _mismatch(names: Iterable[str], params: list[set[str]], state_names: set[str],
              prefix: str) -> tuple[list[str], list[str]]:
    """Weights of the model missing from ``names``, and names that are not the model's."""
    def bare(name: str) -> str:
        return name[len(prefix) + 1:] if prefix and name.startswith(prefix + ".") else name

    have = {bare(n) for n in names}
    missing = sorted(min(group) for group in params if not {bare(n) for n in group} & have)
    return missing, sorted(have - {bare(n) for n in state_names})


def check_names_fit_config(model_dir: str | Path, names: Iterable[str], checkpoint: str | Path) -> None:
    """Refuse a checkpoint whose tensors are not the weights of ``MODEL_DIR``'s architecture.

    ``from_pretrained`` would otherwise initialise the missing weights at random and ignore the
    others, with only a warning. Names may differ by the base-model prefix (``model.``), as
    ``from_pretrained`` allows. Without ``architectures`` in ``config.json`` the common heads are
    tried, and one that fits is enough. Skipped when transformers cannot build the model.
    """
    names = list(names)
    results = [(cls, *_mismatch(names, params, state, prefix))
               for cls, params, state, prefix in _candidates(Path(model_dir))]
    if not results or any(not missing and not unexpected for _, missing, unexpected in results):
        return
    cls, missing, unexpected = min(results, key=lambda r: len(r[1]) + len(r[2]))
    parts = [f"{len(found)} {what} ({', '.join(found[:4])}{', ...' if len(found) > 4 else ''})"
             for found, what in ((missing, "weights missing"), (unexpected, "tensors not in the model"))
             if found]
    raise CheckpointError(f"{checkpoint} does not hold the weights of the {cls} that {Path(model_dir) / 'config.json'} "
                          f"describes: {'; '.join(parts)}; from_pretrained would initialise the missing ones at "
                          "random. Pass the directory of the model that was trained as --hf MODEL_DIR")
