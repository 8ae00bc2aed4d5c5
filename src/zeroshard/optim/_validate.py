"""Value checks shared by the optimizer and scheduler builders.

Each check takes the value and the dotted key it came from (``"optimizer.params.lr"``) and either
returns the value normalised (a float, an int, a tuple) or raises :class:`~zeroshard.errors.ConfigError`
naming that key and saying what was expected.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from zeroshard.errors import ConfigError


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def is_number(value: Any) -> bool:
    """Whether ``value`` is a real number from JSON: an int or float, never a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def number(value: Any, key: str, *, minimum: float | None = None, below: float | None = None) -> float:
    """Check a finite real number, optionally ``>= minimum`` and ``< below``.

    Args:
        value: the configured value.
        key: dotted key path used in the error.
        minimum: inclusive lower bound, or ``None``.
        below: exclusive upper bound, or ``None``.

    Returns:
        The value as a float.

    Raises:
        ConfigError: if the value is not a finite number within the bounds.
    """
    if not is_number(value) or not math.isfinite(value):
        raise ConfigError(f"expected a finite number, got {_describe(value)}", key=key)
    if minimum is not None and value < minimum:
        raise ConfigError(f"must be >= {minimum}, got {value!r}", key=key)
    if below is not None and value >= below:
        raise ConfigError(f"must be < {below}, got {value!r}", key=key)
    return float(value)


def non_negative(value: Any, key: str) -> float:
    """Check a finite number ``>= 0`` (learning rates, epsilons, decay rates)."""
    return number(value, key, minimum=0.0)


def integer(value: Any, key: str, *, minimum: int | None = None) -> int:
    """Check an integer (not a bool), optionally ``>= minimum``.

    Raises:
        ConfigError: if the value is not an int or is below ``minimum``.
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"expected an integer, got {_describe(value)}", key=key)
    if minimum is not None and value < minimum:
        raise ConfigError(f"must be >= {minimum}, got {value!r}", key=key)
    return value


def boolean(value: Any, key: str) -> bool:
    """Check a JSON boolean.

    Raises:
        ConfigError: if the value is not ``True`` or ``False``.
    """
    if not isinstance(value, bool):
        raise ConfigError(f"expected true or false, got {_describe(value)}", key=key)
    return value


def optional_boolean(value: Any, key: str) -> bool | None:
    """Check a JSON boolean or null."""
    return None if value is None else boolean(value, key)


def betas(value: Any, key: str) -> tuple[float, float]:
    """Check an Adam-style ``betas`` pair, each in ``[0, 1)``.

    Returns:
        The pair as a tuple of floats (JSON gives a list; torch's fused kernels want a tuple).

    Raises:
        ConfigError: if the value is not a pair of numbers in ``[0, 1)``.
    """
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError(f"expected a pair [beta1, beta2], got {_describe(value)}", key=key)
    beta1 = number(value[0], f"{key}[0]", minimum=0.0, below=1.0)
    beta2 = number(value[1], f"{key}[1]", minimum=0.0, below=1.0)
    return (beta1, beta2)


def reject_unknown(given: Iterable[str], valid: Iterable[str], prefix: str, what: str) -> None:
    """Raise for the first key of ``given`` that is not in ``valid``.

    Args:
        given: the keys found in the config.
        valid: the keys accepted.
        prefix: dotted prefix of the keys (``"optimizer.params"``).
        what: what the keys configure, for the message (``"optimizer 'Adam'"``).

    Raises:
        ConfigError: naming ``prefix.<unknown key>`` and listing the valid keys.
    """
    valid_set = set(valid)
    for name in given:
        if name not in valid_set:
            raise ConfigError(
                f"unknown parameter {name!r} for {what}; valid parameters: {', '.join(sorted(valid_set))}",
                key=f"{prefix}.{name}",
            )
