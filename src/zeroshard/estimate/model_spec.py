"""What the estimator needs to know about a model, from a module, a factory or a parameter count.

A :class:`ModelSpec` holds the parameter count, the largest module (DeepSpeed's "largest layer"),
the sizes of every parameter and of every ZeRO-3 unit (a module's direct parameters, as zeroshard
partitions them), and, for transformers described by a Hugging Face config, the shape the
activation estimate needs. Models are built on the meta device: no weight is ever allocated, so a
70B model is described in a second. Hugging Face configs are read by :mod:`zeroshard.estimate.hf`.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from zeroshard.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["ModelSpec", "TransformerShape", "parse_count", "spec_from_count", "spec_from_factory",
           "spec_from_module"]

#: Largest layer assumed for a bare parameter count, as a fraction of the parameters (a 7B Llama's
#: embedding is 1.9%, GPT-2's 31%): only DeepSpeed's ZeRO-3 rows depend on it.
ASSUMED_LARGEST_FRACTION = 0.05


@dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer's dimensions, for the activation estimate.

    ``norm`` is ``"layernorm"`` (PyTorch's fused LayerNorm) or ``"rmsnorm"`` (Hugging Face's
    RMSNorm written in Python, which keeps an fp32 copy of its input for backward). ``gated_mlp``
    is the SwiGLU/GeGLU MLP (gate, up and down projections). ``dropout`` says whether any residual
    or embedding dropout is active in training (each keeps a one-byte mask per element).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_positions: int | None = None
    gated_mlp: bool = False
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    dropout: bool = False
    family: str = "transformer"
    activation_saves: int = 1
    """Tensors of the MLP's width the activation function keeps: 1 for fused kernels (``gelu``,
    ``silu``, ``relu``), 4 for GPT-2's ``gelu_new`` written in Python."""
    experts_per_token: int = 1
    """Mixture of experts: MLPs each token runs through (the MLP activations scale with it)."""
    exact: bool = True
    """False when the shape was read from generic config keys of a family zeroshard does not
    know (the activation estimate is then approximate)."""


@dataclass(frozen=True)
class ModelSpec:
    """A model as the estimator sees it.

    Attributes:
        description: what was estimated, for the table's header.
        total_params: parameters, a tensor shared by several modules once.
        largest_layer_params: most direct parameters of one module (DeepSpeed's definition).
        largest_layer_name: that module's name, when known.
        param_numels: every parameter's element count (for per-rank padding), when known.
        units: ZeRO-3 units' element counts (each module's direct parameters not already owned
            by an earlier module), when known.
        unit_param_counts: how many parameters each unit has (``param_numels`` lists them unit
            after unit), when known: per-unit padding on N ranks.
        transformer: the transformer shape for activations; ``None`` for models the estimator
            cannot see inside (a factory's or a bare count).
        largest_assumed: the largest layer was not known and is assumed (a bare count).
    """

    description: str
    total_params: int
    largest_layer_params: int
    largest_layer_name: str | None = None
    param_numels: tuple[int, ...] | None = None
    units: tuple[int, ...] | None = None
    transformer: TransformerShape | None = None
    unit_param_counts: tuple[int, ...] | None = None
    largest_assumed: bool = False


def spec_from_module(model: torch.nn.Module, description: str,
                     transformer: TransformerShape | None = None) -> ModelSpec:
    """Describe a built model (on any device, the meta device included)."""
    from zeroshard.core.zero3.units import is_leaf, unit_modules
    from zeroshard.estimate.formulas import zero2_model_to_params

    largest, largest_name = 0, None
    for name, m in model.named_modules():
        n = sum(p.numel() for p in m.parameters(recurse=False))
        if n > largest:
            largest, largest_name = n, name or type(m).__name__
    seen: set[int] = set()
    units: list[int] = []
    counts: list[int] = []
    numels: list[int] = []
    for m in unit_modules(model):
        mine = [p for p in m.parameters(recurse=is_leaf(m)) if id(p) not in seen]
        seen.update(id(p) for p in mine)
        if mine:
            units.append(sum(p.numel() for p in mine))
            counts.append(len(mine))
            numels.extend(p.numel() for p in mine)
    return ModelSpec(description=description, total_params=zero2_model_to_params(model),
                     largest_layer_params=largest, largest_layer_name=largest_name,
                     param_numels=tuple(numels), units=tuple(units), transformer=transformer,
                     unit_param_counts=tuple(counts))


_COUNT = re.compile(r"\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*([kKmMbBtT]?)\s*")
_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def parse_count(text: str, what: str = "--params") -> int:
    """``"7e9"``, ``"7B"``, ``"125M"``, ``"1.3b"`` -> a positive whole number of parameters."""
    m = _COUNT.fullmatch(text)
    if not m:
        raise ConfigError(f"cannot read {text!r} as a parameter count; write e.g. 7e9, 7B or 125M", key=what)
    n = int(float(m.group(1)) * _COUNT_SUFFIX[m.group(2).upper()])
    if n <= 0:
        raise ConfigError(f"a model needs at least one parameter, got {text!r}", key=what)
    return n


def spec_from_count(total_params: int, largest_layer_params: int | None = None) -> ModelSpec:
    """A model known only by its parameter count (and optionally its largest layer)."""
    if largest_layer_params is not None and not 0 < largest_layer_params <= total_params:
        raise ConfigError(f"the largest layer ({largest_layer_params}) must be between 1 and the parameter count "
                          f"({total_params})", key="--largest-layer")
    assumed = largest_layer_params is None
    largest = max(1, int(total_params * ASSUMED_LARGEST_FRACTION)) if assumed else int(largest_layer_params or 0)
    return ModelSpec(description="a model given by its parameter count", total_params=total_params,
                     largest_layer_params=largest, largest_assumed=assumed)


def format_count(n: int | float) -> str:
    """``6738415616`` -> ``"6.74B"``."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return str(int(n))


def _load_factory(target: str) -> object:
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"expected pkg.module:function or path/to/file.py:function, got {target!r}", key="MODEL")
    is_file = module_name.endswith(".py")
    if is_file and not Path(module_name).is_file():
        raise ConfigError(f"{target!r}: file {module_name} does not exist", key="MODEL")
    # The file's neighbours, or the current directory's modules (as ``python -m`` finds them).
    search = str(Path(module_name).resolve().parent) if is_file else str(Path.cwd())
    sys.path.insert(0, search)
    try:
        if is_file:
            spec = importlib.util.spec_from_file_location(f"_zeroshard_factory_{Path(module_name).stem}", module_name)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as e:  # the user's module: anything may go wrong in it
        raise ConfigError(f"cannot import {module_name!r} for {target!r}: {type(e).__name__}: {e}", key="MODEL") from e
    finally:
        sys.path.remove(search)
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ConfigError(f"{module_name!r} has no attribute {attr!r} (from {target!r})", key="MODEL")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ConfigError(f"{target!r} is not callable", key="MODEL")
    return fn


def spec_from_factory(target: str) -> ModelSpec:
    """Build the model that ``pkg.module:fn()`` (or ``file.py:fn()``) returns on the meta device.

    The factory is called with no arguments inside ``torch.device("meta")``, so parameters it
    creates have shapes but no storage. Activations cannot be estimated for such a model (its
    structure is unknown): give a Hugging Face config or ``--activation-bytes`` for them.
    """
    import torch

    fn = _load_factory(target)
    try:
        with torch.device("meta"):
            model = fn()  # type: ignore[operator]
    except Exception as e:  # the user's factory
        raise ConfigError(f"cannot build the model from {target!r}: {type(e).__name__}: {e}", key="MODEL") from e
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"{target!r} returned {type(model).__name__}, not a torch.nn.Module", key="MODEL")
    if not any(True for _ in model.parameters()):
        raise ConfigError(f"the model from {target!r} has no parameters", key="MODEL")
    return spec_from_module(model, f"{type(model).__name__} from {target}")
