"""The ``zeroshard`` logger's default output: visible without any logging set-up, silent once there is.

DeepSpeed gives its logger a stdout handler at import and stops propagation, so its lines show
in a bare script but bypass the application's own logging. Here :func:`install_default_handler`
adds one stderr handler to the ``zeroshard`` logger only when nothing would print its records
(no handler on it or its ancestors), and that handler steps aside as soon as the application
configures the root logger later (``logging.basicConfig`` after ``initialize``), so no line is
printed twice. Informational records come from rank 0 only (warnings from every rank), so a job
of N ranks prints one report line per interval, not N.

To silence the reports: ``logging.getLogger("zeroshard").setLevel(logging.WARNING)``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

import torch.distributed as dist

LOGGER_NAME = "zeroshard"
FORMAT = "[%(asctime)s] [%(levelname)s] [zeroshard] %(message)s"


def current_rank() -> int:
    """This process's global rank: the process group's, else ``$RANK``, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class DefaultHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr handler that prints rank 0's records (and every rank's warnings) while the
    application has configured no root handler of its own."""

    def __init__(self, rank: Callable[[], int] = current_rank) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter(FORMAT))
        self._rank = rank

    def filter(self, record: logging.LogRecord) -> bool:  # type: ignore[override]
        """Drop a record that the root logger's handlers print, and rank > 0's info lines."""
        if logging.getLogger().handlers:  # configured after us: propagation prints it there
            return False
        if record.levelno < logging.WARNING and self._rank() != 0:
            return False
        return bool(super().filter(record))

    def emit(self, record: logging.LogRecord) -> None:
        # The stream is looked up at each record (not bound at construction) so that a replaced
        # sys.stderr (pytest's capture, a redirect) receives the lines.
        self.stream = sys.stderr
        super().emit(record)


def install_default_handler(logger: logging.Logger | None = None) -> bool:
    """Give the ``zeroshard`` logger a stderr handler at INFO level when nothing prints its records.

    Nothing is changed when the logger or one of its ancestors has a handler (the user configured
    logging) or when the default handler is already installed. The logger's level is set to INFO
    only when it is unset (NOTSET), so an explicit ``setLevel`` wins.

    Returns:
        Whether a handler was installed now.
    """
    logger = logger or logging.getLogger(LOGGER_NAME)
    if any(isinstance(h, DefaultHandler) for h in logger.handlers) or logger.hasHandlers():
        return False
    logger.addHandler(DefaultHandler())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    return True
