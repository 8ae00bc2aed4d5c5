"""Shared building blocks of the config schema: the base model and the scalar field types.

Numbers are validated strictly (a JSON string ``"32"`` or a boolean is not a number), except that an
integral float such as ``5e7`` is accepted for an integer field and converted to ``int``, because
DeepSpeed configs customarily write bucket sizes that way.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Strict

__all__ = [
    "DTYPES",
    "ConfigModel",
    "DTypeName",
    "Float",
    "Int",
    "dtype_of",
    "upper_if_str",
]


class ConfigModel(BaseModel):
    """Base of every config block: unknown keys are errors, field docstrings become descriptions."""

    model_config = ConfigDict(
        extra="forbid",
        validate_default=True,
        allow_inf_nan=False,
        use_attribute_docstrings=True,
        protected_namespaces=(),
    )


def _integral(value: Any) -> Any:
    """Turn an integral float (``5e7``) into an int; anything else goes on to strict int checking."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, Strict(), BeforeValidator(_integral)]
"""An integer; integral floats such as ``5e7`` are accepted and converted, strings and bools are not."""

Float = Annotated[float, Strict()]
"""A finite number (int or float); strings and bools are rejected."""

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
"""Canonical dtype names used in the config, mapped to torch dtypes."""

_DTYPE_ALIASES: dict[str, str] = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
}


def _canonical_dtype(value: Any) -> Any:
    """Map DeepSpeed's dtype spellings (``"float16"``, ``"torch.bfloat16"``, any case) to fp32/fp16/bf16."""
    if isinstance(value, str):
        return _DTYPE_ALIASES.get(value.strip().lower(), value)
    return value


DTypeName = Annotated[Literal["fp32", "fp16", "bf16"], BeforeValidator(_canonical_dtype)]
"""A floating dtype name; DeepSpeed's aliases (``float16``, ``half``, ``torch.bfloat16``...) are accepted."""


def dtype_of(name: str | None, default: torch.dtype) -> torch.dtype:
    """Return the torch dtype for a canonical dtype name, or ``default`` when ``name`` is None.

    Args:
        name: ``"fp32"``, ``"fp16"``, ``"bf16"`` or None.
        default: dtype returned for None.

    Returns:
        The matching ``torch.dtype``.
    """
    return default if name is None else DTYPES[name]


def upper_if_str(value: Any) -> Any:
    """Upper-case a string (for case-insensitive enumerations); other values pass through unchanged."""
    return value.upper() if isinstance(value, str) else value
