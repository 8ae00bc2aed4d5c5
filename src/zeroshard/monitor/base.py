"""What every monitor is: a sink of ``(tag, value, x)`` scalar events, as in DeepSpeed.

An event is DeepSpeed's tuple: the tag (``"Train/Samples/train_loss"``), the value, and the
x-axis position, which the engine sets to the global number of training samples seen (DeepSpeed's
``global_samples``). :func:`require` turns a missing optional package into an error that names the
config key and the package to install, raised on every rank alike (the config is the same
everywhere), so no rank trains on while another has failed.
"""

from __future__ import annotations

import importlib.util
from typing import Protocol

from zeroshard.errors import ConfigError

Event = tuple[str, float, int]
"""``(tag, value, global samples)``."""


class Monitor(Protocol):
    """A monitor backend (TensorBoard, CSV files, W&B, Comet)."""

    def write_events(self, events: list[Event]) -> None:
        """Record scalar events (buffered until :meth:`flush`)."""

    def flush(self) -> None:
        """Make everything written so far durable against a crash of this process."""

    def close(self) -> None:
        """Flush and release files and connections."""


def require(package: str, key: str, pip_name: str | None = None) -> None:
    """Raise :class:`ConfigError` for ``key`` when ``package`` cannot be imported.

    Args:
        package: the import name (``"wandb"``).
        key: the config key that asked for it (``"wandb.enabled"``).
        pip_name: what to ``pip install`` when it differs from ``package``.
    """
    if importlib.util.find_spec(package) is None:
        raise ConfigError(
            f"this monitor needs the '{package}' package, which is not installed: "
            f"pip install {pip_name or package} (or set {key} to false)",
            key=key,
        )
