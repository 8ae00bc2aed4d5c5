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

import contextlib
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from zeroshard.checkpoint.consolidate import convert_checkpoint, export_names, open_checkpoint
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
    with open_checkpoint(checkpoint_dir, tag) as src:
        shapes = {n: tuple(src.params[n].shape) if n in src.params else None for n in export_names(src)}
    named = _architectures(config)
    fits = check_names_fit_config(model_dir, shapes, checkpoint_dir, named)
    files = convert_checkpoint(checkpoint_dir, out, tag=tag, dtype=dtype,
                               max_shard_size=max_shard_size or DEFAULT_MAX_SHARD_SIZE)
    if len(fits) == 1 and named != fits:
        # save_pretrained writes the class it saves (pipelines and serving read it)
        logger.warning("config.json of %s: architectures %s -> %s, the one class the weights fit", out,
                       config.get("architectures"), fits)
        config["architectures"] = fits
    elif len(fits) > 1 and not set(named) & set(fits):
        logger.warning("config.json's architectures %s is not what the weights are; they fit %s: set it to the "
                       "class trained", config.get("architectures"), ", ".join(fits))
    config["dtype"] = _DTYPE_NAMES[dtype]
    config.pop("torch_dtype", None)  # transformers 5 reads "dtype"; one key, so they cannot disagree
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    files.append(out / "config.json")
    for name in MODEL_FILES[1:]:
        if (model_dir / name).is_file():
            if not ((out / name).exists() and (out / name).samefile(model_dir / name)):  # OUT may be MODEL_DIR
                shutil.copyfile(model_dir / name, out / name)
            files.append(out / name)
    return files


def _class_names(config: Any) -> list[str]:
    """Model classes for ``config``: the one ``architectures`` names first, then every class
    transformers maps the model type to (base model and each head: causal LM, QA, image
    classification...), for a config that names none or names another head than the one trained
    (``config.save_pretrained`` writes ``null``; a fine-tune of a hub model keeps the hub's)."""
    from transformers.models.auto import modeling_auto

    named: list[str] = list((getattr(config, "architectures", None) or [])[:1])
    mapped: list[str] = []
    for table in sorted(n for n in dir(modeling_auto) if n.startswith("MODEL") and n.endswith("_MAPPING_NAMES")):
        value = getattr(modeling_auto, table).get(getattr(config, "model_type", None))
        for name in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(name, str) and name not in named + mapped:
                mapped.append(name)
    return named + mapped


def _candidates(model_dir: Path) -> Iterator[tuple[str, list[set[str]], dict[str, tuple[int, ...]], str]]:
    """For each model class ``config.json`` may describe, in the order of :func:`_class_names`: its
    name, one set of names per parameter (tied names together), every ``state_dict`` name with its
    shape and the base-model prefix. Nothing when transformers is absent or cannot read the config
    (custom code)."""
    try:
        import transformers
    except ImportError:
        return
    try:
        config = transformers.AutoConfig.from_pretrained(model_dir)
        names = _class_names(config)
    except Exception as e:  # a config this transformers cannot read is not ours to judge
        logger.info("not checking tensor names against %s: %s", model_dir, e)
        return
    for name in names:
        cls = getattr(transformers, name, None)
        if cls is None:
            continue
        try:
            with torch.device("meta"), _quiet_transformers():  # names and ties only: no memory, no initialisation
                model = cls(config)
        except Exception:  # a head this config cannot build
            continue
        tied: dict[int, set[str]] = {}
        for param_name, param in model.named_parameters(remove_duplicate=False):
            tied.setdefault(id(param), set()).add(param_name)
        state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        yield name, list(tied.values()), state, getattr(model, "base_model_prefix", "") or ""


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Building heads the user did not ask for makes transformers warn about them (``is_decoder``)."""
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _mismatch(shapes: dict[str, tuple[int, ...] | None], params: list[set[str]],
              state: dict[str, tuple[int, ...]], prefix: str) -> tuple[list[str], list[str]]:
    """Weights of the model missing from the checkpoint (or of another shape: a head with another
    number of labels), and the checkpoint's names (as stored) that are not the model's."""
    def bare(name: str) -> str:
        return name[len(prefix) + 1:] if prefix and name.startswith(prefix + ".") else name

    have = {bare(n): shape for n, shape in shapes.items()}
    known = {bare(n): shape for n, shape in state.items()}

    def found(name: str) -> bool:
        key = bare(name)
        return key in have and have[key] in (None, known.get(key))

    missing = sorted(min(group) for group in params if not any(found(n) for n in group))
    return missing, sorted(n for n in shapes if bare(n) not in known)


def _hint(unexpected: list[str]) -> str:
    """What usually makes names not fit: PEFT's wrapper, or a module wrapping the model."""
    if unexpected and all(n.startswith("base_model.model.") for n in unexpected):
        return (" The names are PEFT's (base_model.model.*): merge the adapters into the model "
                "(model.merge_and_unload()) and save that, or save the adapters with PEFT's save_pretrained.")
    heads = {n.split(".", 1)[0] for n in unexpected}
    if len(heads) == 1 and all("." in n for n in unexpected):
        return (f" Every such name starts with {next(iter(heads))!r}.: the model was trained inside a wrapper "
                "module; save the inner model's weights, or convert to safetensors without --hf and rename them.")
    return ""


def check_names_fit_config(model_dir: str | Path, shapes: dict[str, tuple[int, ...] | None],
                           checkpoint: str | Path, named: list[str]) -> list[str]:
    """Refuse a checkpoint whose tensors are not the weights of a model ``MODEL_DIR``'s config builds.

    ``from_pretrained`` would otherwise initialise the missing weights at random and ignore the
    others, with only a warning. The class ``architectures`` names is tried first, then every class
    transformers has for the model type (a config without ``architectures``, or one naming another
    head than the one trained). Names may differ by the base-model prefix (``model.``), as
    ``from_pretrained`` allows; trained parameters must have the model's shapes.

    Args:
        model_dir: the directory holding ``config.json``.
        shapes: the checkpoint's tensor names, with the shape of each trained parameter (``None``:
            not checked).
        checkpoint: the checkpoint, for the message.
        named: the classes ``config.json``'s ``architectures`` lists.

    Returns:
        The classes the weights fit: ``architectures``' own alone when it fits; empty when nothing
        could be checked (transformers absent, a config it cannot build).
    """
    best: tuple[str, list[str], list[str]] | None = None
    fits: list[str] = []
    for cls, params, state, prefix in _candidates(Path(model_dir)):
        missing, unexpected = _mismatch(shapes, params, state, prefix)
        if not missing and not unexpected:
            if cls in named:  # tried first: the other classes need not be built
                return [cls]
            fits.append(cls)
        elif best is None or len(missing) + len(unexpected) < len(best[1]) + len(best[2]):
            best = (cls, missing, unexpected)
    if fits or best is None:
        return fits
    cls, missing, unexpected = best
    parts = [f"{len(found)} {what} ({', '.join(found[:4])}{', ...' if len(found) > 4 else ''})"
             for found, what in ((missing, "weights missing or of another shape"),
                                 (unexpected, "tensors not in the model")) if found]
    raise CheckpointError(f"{checkpoint} does not hold the weights of any model {Path(model_dir) / 'config.json'} "
                          f"describes; the closest, {cls}: {'; '.join(parts)}. from_pretrained would initialise the "
                          f"missing ones at random.{_hint(unexpected)}")


def _architectures(config: dict[str, object]) -> list[str]:
    """The classes a ``config.json`` lists under ``architectures`` (``null`` when saved without a model)."""
    value = config.get("architectures")
    return [a for a in value if isinstance(a, str)] if isinstance(value, list) else []
