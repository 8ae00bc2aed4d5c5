"""CSV monitor: one file per tag under ``output_path/job_name``, DeepSpeed's layout.

A tag ``Train/Samples/train_loss`` goes to ``Train_Samples_train_loss.csv`` (``/`` and spaces
become ``_``) whose header is ``step,train_loss`` (the tag's last component) and whose rows are
``x,value``. DeepSpeed opens the file for every event; here each file stays open and is flushed
once per reporting interval. A header is written only to a new or empty file, so a resumed job
appends rows under the existing header (DeepSpeed writes a second header).
"""

from __future__ import annotations

import csv
import os
from typing import IO, Any

from zeroshard.monitor.base import Event


def file_name(tag: str) -> str:
    """The CSV file name of ``tag`` (DeepSpeed's sanitisation)."""
    return tag.replace("/", "_").replace(" ", "_") + ".csv"


class CSVMonitor:
    """Scalars appended to one CSV file per tag."""

    def __init__(self, config: Any) -> None:
        """Create ``config.output_path/config.job_name`` (a ``csv_monitor`` config block)."""
        self.log_dir = os.path.join(config.output_path, config.job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self._files: dict[str, tuple[IO[str], Any]] = {}

    def _writer(self, tag: str) -> Any:
        entry = self._files.get(tag)
        if entry is None:
            f = open(os.path.join(self.log_dir, file_name(tag)), "a", newline="", encoding="utf-8")  # noqa: SIM115
            writer = csv.writer(f)
            if f.tell() == 0:
                writer.writerow(["step", tag.split("/")[-1]])
            entry = self._files[tag] = (f, writer)
        return entry[1]

    def write_events(self, events: list[Event]) -> None:
        """Append one row per event to its tag's file."""
        for tag, value, x in events:
            self._writer(tag).writerow([x, value])

    def flush(self) -> None:
        """Hand the buffered rows to the operating system (they survive a crash of this process)."""
        for f, _ in self._files.values():
            f.flush()

    def close(self) -> None:
        """Flush and close every file."""
        for f, _ in self._files.values():
            f.close()
        self._files.clear()
