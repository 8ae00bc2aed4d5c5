"""Features that zeroshard will support but does not yet: one table, one row per feature.

When the issue implementing a feature lands, delete its row. :func:`check_supported` raises
:class:`NotYetSupportedError` for the first row whose predicate holds, so such a config is never
silently run with the feature missing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from zeroshard.config.schema import ZeroshardConfig
from zeroshard.errors import NotYetSupportedError

__all__ = ["NOT_YET_SUPPORTED", "NotYetSupported", "check_supported"]


class NotYetSupported(NamedTuple):
    """One not-yet-supported feature: loading fails when ``applies(value of key)`` holds."""

    key: str
    """Dotted key path whose value is tested (and named in the error)."""
    applies: Callable[[Any], bool]
    """Predicate on the key's value: True when the config uses the feature."""
    feature: str
    """What is not supported yet, for the message."""
    issue: str
    """The planned work that will add it, for the message."""

    @property
    def message(self) -> str:
        """The error message."""
        return f"{self.feature} is not yet supported (planned: {self.issue})"


# fmt: off
NOT_YET_SUPPORTED: list[NotYetSupported] = []
"""Features not supported yet, checked in order by :func:`check_supported`. Delete a row when its feature
lands."""
# fmt: on


def _value(cfg: ZeroshardConfig, path: str) -> Any:
    node: Any = cfg
    for part in path.split("."):
        node = getattr(node, part)
    return node


def check_supported(cfg: ZeroshardConfig) -> None:
    """Raise for the first feature of ``cfg`` listed in :data:`NOT_YET_SUPPORTED`.

    Args:
        cfg: a validated config.

    Raises:
        NotYetSupportedError: with ``key`` set to the dotted path of the feature's key.
    """
    for row in NOT_YET_SUPPORTED:
        if row.applies(_value(cfg, row.key)):
            raise NotYetSupportedError(row.message, key=row.key)
