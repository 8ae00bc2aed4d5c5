"""Monitoring: wall-clock timers now; TensorBoard/CSV writers come with the monitoring issue."""

from zeroshard.monitor.timers import WallClockTimers

__all__ = ["WallClockTimers"]
