"""Monitoring: the progress report, the default log handler, wall-clock timers and the monitors.

- :mod:`.report`: the line every ``steps_per_print`` steps and the scalars for the monitors;
- :mod:`.logs`: a stderr handler for the ``zeroshard`` logger when the application has none;
- :mod:`.timers`, :mod:`.gather_timing`: ``wall_clock_breakdown``;
- :mod:`.master` and the backends (:mod:`.tensorboard`, :mod:`.csv_monitor`, :mod:`.wandb`,
  :mod:`.comet`): DeepSpeed's monitor config blocks and file layout;
- :mod:`.memory`: host and device memory figures.
"""

from zeroshard.monitor.logs import install_default_handler
from zeroshard.monitor.master import MonitorMaster
from zeroshard.monitor.report import Reporter
from zeroshard.monitor.timers import WallClockTimers

__all__ = ["MonitorMaster", "Reporter", "WallClockTimers", "install_default_handler"]
