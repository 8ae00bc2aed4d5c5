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
        if key == "":  # a key that is the empty string: say so, or the message names none
            message = f"key '': {message}"
        elif key:
            message = f"{key}: {message}"
        super().__init__(message)


class NotYetSupportedError(ConfigError):
    """A DeepSpeed feature that zeroshard will support but does not yet: never silently ignored."""


class UnusedParametersError(ConfigError, AssertionError):
    """Trainable parameters got no gradient in an accumulation window (``ignore_unused_parameters:
    false``). Also an ``AssertionError``, the type DeepSpeed raises there, for scripts that catch it."""


class CheckpointError(ZeroshardError):
    """A checkpoint that is missing, incomplete, corrupt, or unsafe to load."""


class TagMismatchError(CheckpointError, AssertionError):
    """Ranks named different checkpoint tags under ``checkpoint.tag_validation: Fail``. Also an
    ``AssertionError``, the type DeepSpeed raises there, for scripts that catch it."""


class DistributedError(ZeroshardError, RuntimeError):
    """A problem with the process group or with shapes that would make a collective hang."""


class OffloadIOError(ZeroshardError, OSError):
    """A failed read or write of an NVMe offload swap file (disk full, I/O error, short read).

    Attributes:
        path: the swap file, or ``None``.
        errno: the operating system's error number, or ``None`` (a short read has none).
    """

    def __init__(self, message: str, path: str | None = None, errno: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.filename = path
        self.errno = errno

    def __str__(self) -> str:
        # OSError's own __str__ would print "[Errno n] None: 'path'" once errno and filename are set.
        return str(self.args[0])

    def __reduce__(self) -> tuple[type[OffloadIOError], tuple[str, str | None, int | None]]:
        # Pickle through the constructor's arguments, so the error survives a trip between processes.
        return (type(self), (str(self.args[0]), self.path, self.errno))
