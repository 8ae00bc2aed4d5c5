"""The fan-out to every configured monitor (DeepSpeed's ``MonitorMaster``), writing from rank 0.

``enabled`` follows the config, so it is the same on every rank (the engine relies on that to
make the same collectives everywhere); the backends exist on rank 0 only. Each backend's
package is checked on every rank before rank 0 opens anything, so a missing package fails the
whole job at ``initialize`` with a :class:`~zeroshard.errors.ConfigError` naming the key.
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Callable
from typing import Any

from zeroshard.monitor.base import Event, Monitor, require

#: config block -> (package to import, pip name, backend module and class), in DeepSpeed's order.
BACKENDS: dict[str, tuple[str | None, str | None, str]] = {
    "tensorboard": ("tensorboard", None, "zeroshard.monitor.tensorboard:TensorBoardMonitor"),
    "wandb": ("wandb", None, "zeroshard.monitor.wandb:WandbMonitor"),
    "csv_monitor": (None, None, "zeroshard.monitor.csv_monitor:CSVMonitor"),
    "comet": ("comet_ml", "'comet_ml>=3.41.0'", "zeroshard.monitor.comet:CometMonitor"),
}


def _backend_class(path: str) -> Callable[[Any], Monitor]:
    import importlib

    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


class MonitorMaster:
    """Every enabled monitor of a config, behind one ``write_events``/``flush``/``close``."""

    def __init__(self, config: Any, rank: int) -> None:
        """Open the monitors that ``config`` (a validated config) enables, on rank 0 only."""
        blocks = [key for key in BACKENDS if getattr(config, key).enabled]
        self.enabled = bool(blocks)
        for key in blocks:
            package, pip_name, _ = BACKENDS[key]
            if package is not None:
                require(package, f"{key}.enabled", pip_name)
        self.monitors: list[Monitor] = []
        if rank == 0:
            self.monitors = [_backend_class(BACKENDS[key][2])(getattr(config, key)) for key in blocks]
        if self.monitors:  # a script that never calls engine.destroy(): its event files end complete
            atexit.register(_close_at_exit, weakref.ref(self))

    def write_events(self, events: list[Event]) -> None:
        """Hand the events to every monitor (a no-op off rank 0)."""
        for m in self.monitors:
            m.write_events(events)

    def flush(self) -> None:
        """Flush every monitor."""
        for m in self.monitors:
            m.flush()

    def close(self) -> None:
        """Close every monitor; later writes are dropped."""
        for m in self.monitors:
            m.close()
        self.monitors = []


def _close_at_exit(ref: weakref.ref[MonitorMaster]) -> None:
    master = ref()
    if master is not None:
        master.close()
