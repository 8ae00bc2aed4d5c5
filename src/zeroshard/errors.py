"""User-facing error types.

Every error a user can cause (a bad config, a bad checkpoint, a bad CLI argument) is one of these,
with a message that names the culprit (key, file, parameter) and what was expected. Internal
invariants may still use ``assert``; user input never does.
"""

from __future__ import annotations


class ZeroshardError(Exception):
    """Base class of all errors raised by zeroshard for user-caused problems."""


class ConfigError(ZeroshardError, ValueError):
    """An invalid or unsupported configuration value.

    Attributes:
        key: dotted path of the offending key (``"zero_optimization.stage"``), or ``None`` when the
            problem spans several keys.
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


class NotYetSupportedError(ConfigError):
    """A DeepSpeed feature that zeroshard will support but does not yet: never silently ignored."""


class CheckpointError(ZeroshardError):
    """A checkpoint that is missing, incomplete, corrupt, or unsafe to load."""


class DistributedError(ZeroshardError, RuntimeError):
    """A problem with the process group or with shapes that would make a collective hang."""
