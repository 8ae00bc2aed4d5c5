"""TensorBoard monitor: event files under ``output_path/job_name``, as DeepSpeed writes them.

Written through torch's ``SummaryWriter`` (which needs the ``tensorboard`` package: the
``monitor`` extra). ``output_path`` empty means the current directory, as in DeepSpeed, so the
files land in ``./<job_name>/``.
"""

from __future__ import annotations

import os
from typing import Any

from zeroshard.monitor.base import Event, require


class TensorBoardMonitor:
    """Scalars to a TensorBoard event file, flushed at each :meth:`flush`."""

    def __init__(self, config: Any) -> None:
        """Open ``config.output_path/config.job_name`` (a ``tensorboard`` config block)."""
        require("tensorboard", "tensorboard.enabled")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = os.path.join(config.output_path, config.job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        # Flushing is ours (once per reporting interval); the writer's own timer would add a thread wake-up.
        self.writer = SummaryWriter(log_dir=self.log_dir, flush_secs=10**6)

    def write_events(self, events: list[Event]) -> None:
        """Add each event as a scalar at step ``x``."""
        for tag, value, x in events:
            self.writer.add_scalar(tag, value, x)

    def flush(self) -> None:
        """Write the pending events to the file."""
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()
