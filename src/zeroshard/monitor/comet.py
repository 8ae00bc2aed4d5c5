"""Comet monitor: ``comet_ml.start(...)`` with the ``comet`` block's keys, then each tag logged at
most once per ``samples_log_interval`` samples (DeepSpeed's ``EventsLogScheduler``)."""

from __future__ import annotations

from typing import Any

from zeroshard.errors import ConfigError
from zeroshard.monitor.base import Event, require

MIN_VERSION = (3, 41)
"""``comet_ml.start`` appeared in 3.41 (DeepSpeed requires the same)."""


class CometMonitor:
    """Scalars to a Comet experiment."""

    def __init__(self, config: Any) -> None:
        """Start the experiment described by a ``comet`` config block."""
        require("comet_ml", "comet.enabled", pip_name="'comet_ml>=3.41.0'")
        import comet_ml

        version = tuple(int(p) for p in comet_ml.__version__.split(".")[:2] if p.isdigit())
        if version < MIN_VERSION:
            raise ConfigError(f"the Comet monitor needs comet_ml >= 3.41.0, found {comet_ml.__version__}: "
                              "pip install -U comet_ml", key="comet.enabled")
        self.interval = int(config.samples_log_interval)
        self.experiment = comet_ml.start(api_key=config.api_key, project=config.project,
                                         workspace=config.workspace, experiment_key=config.experiment_key,
                                         mode=config.mode, online=config.online)
        if config.experiment_name is not None:
            self.experiment.set_name(config.experiment_name)
        self._last: dict[str, int] = {}

    def write_events(self, events: list[Event]) -> None:
        """Log each event whose tag was last logged at least ``samples_log_interval`` samples ago."""
        for tag, value, x in events:
            last = self._last.get(tag)
            if last is None or x - last >= self.interval:
                self._last[tag] = x
                self.experiment.log_metric(tag, value, step=x)

    def flush(self) -> None:
        """Comet sends in the background; nothing to do."""

    def close(self) -> None:
        """End the experiment (sends what is queued)."""
        self.experiment.end()
