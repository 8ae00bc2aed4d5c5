"""Weights & Biases monitor: ``wandb.init(project, group, entity=team)``, then one ``wandb.log``
per x-axis position with every tag of that position (DeepSpeed logs each event on its own)."""

from __future__ import annotations

from typing import Any

from zeroshard.monitor.base import Event, require


class WandbMonitor:
    """Scalars to a W&B run."""

    def __init__(self, config: Any) -> None:
        """Start the run described by a ``wandb`` config block."""
        require("wandb", "wandb.enabled")
        import wandb

        self._wandb = wandb
        self.run = wandb.init(project=config.project, group=config.group, entity=config.team)

    def write_events(self, events: list[Event]) -> None:
        """Log the events, grouped by x (W&B wants one call per step, in increasing order)."""
        by_x: dict[int, dict[str, float]] = {}
        for tag, value, x in events:
            by_x.setdefault(x, {})[tag] = value
        for x in sorted(by_x):
            self._wandb.log(by_x[x], step=x)

    def flush(self) -> None:
        """W&B sends in the background; nothing to do."""

    def close(self) -> None:
        """Finish the run."""
        self._wandb.finish()
