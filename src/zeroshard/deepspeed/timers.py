"""DeepSpeed's ``deepspeed.utils.timer``: :class:`SynchronizedWallClockTimer` and :class:`ThroughputTimer`.

Scripts and libraries built on DeepSpeed (Megatron-DeepSpeed, DeepSpeed-MII, pipeline trainers)
import these two classes to time their own code; zeroshard's engine keeps its own timers
(:mod:`zeroshard.monitor.timers`) and, as DeepSpeed's, a :class:`ThroughputTimer` as ``engine.tput_timer``
(DeepSpeed-Chat calls ``update_epoch_count()`` on it). Same constructor arguments, methods and printed formats as
DeepSpeed 0.19.8. On CUDA a timer records device events, so it measures the work queued between
``start`` and ``stop`` without synchronising there; elsewhere it reads the host clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist

from zeroshard.deepspeed.accelerator import get_accelerator
from zeroshard.deepspeed.utils.logging import logger

__all__ = ["BACKWARD_GLOBAL_TIMER", "BACKWARD_INNER_GLOBAL_TIMER", "BACKWARD_INNER_MICRO_TIMER",
           "BACKWARD_MICRO_TIMER", "BACKWARD_REDUCE_GLOBAL_TIMER", "BACKWARD_REDUCE_MICRO_TIMER",
           "FORWARD_GLOBAL_TIMER", "FORWARD_MICRO_TIMER", "STEP_GLOBAL_TIMER", "STEP_MICRO_TIMER",
           "NoopTimer", "SynchronizedWallClockTimer", "ThroughputTimer", "trim_mean"]

# DeepSpeed's timer names (its engine's wall_clock_breakdown)
FORWARD_MICRO_TIMER = "fwd_microstep"
FORWARD_GLOBAL_TIMER = "fwd"
BACKWARD_MICRO_TIMER = "bwd_microstep"
BACKWARD_GLOBAL_TIMER = "bwd"
BACKWARD_INNER_MICRO_TIMER = "bwd_inner_microstep"
BACKWARD_INNER_GLOBAL_TIMER = "bwd_inner"
BACKWARD_REDUCE_MICRO_TIMER = "bwd_allreduce_microstep"
BACKWARD_REDUCE_GLOBAL_TIMER = "bwd_allreduce"
STEP_MICRO_TIMER = "step_microstep"
STEP_GLOBAL_TIMER = "step"
_EPSILON = 1e-6


def _print_on(message: str, ranks: list[int]) -> None:
    """Print on the listed ranks (``-1``: all), or always without a process group (DeepSpeed's print_dist)."""
    if not (dist.is_available() and dist.is_initialized()) or -1 in ranks or dist.get_rank() in ranks:
        print(message)


def trim_mean(data: Iterable[float], trim_percent: float) -> float:
    """The mean of ``data`` without its ``trim_percent`` smallest and largest values (0 when empty)."""
    if not 0.0 <= trim_percent <= 1.0:
        raise ValueError(f"trim_percent must lie in [0, 1], got {trim_percent}")
    values = sorted(data)
    if not values:
        return 0
    k = int(round(len(values) * trim_percent))
    kept = values[k:len(values) - k]
    return sum(kept) / len(kept) if kept else float("nan")  # numpy's mean of nothing, as DeepSpeed


class SynchronizedWallClockTimer:
    """A group of named timers (DeepSpeed's, after Megatron's): ``timers("fwd").start()``, ``.stop()``,
    ``timers.log(["fwd"])``. Times are in milliseconds."""

    class Timer:
        """One named timer: the durations of its start-stop intervals since the last reset."""

        def __init__(self, name: str) -> None:
            self.name_ = name
            self.started_ = False
            self.use_host_timer = get_accelerator().use_host_timers()
            self.elapsed_records: list[float] | None = None
            self._intervals: list[Callable[[], float]] = []  # each gives its duration in milliseconds
            self._start: Any = None

        def start(self) -> None:
            """Start an interval."""
            if self.started_:
                raise RuntimeError(f"{self.name_} timer has already been started")
            if self.use_host_timer:
                self._start = time.time()
            else:
                self._start = get_accelerator().Event(enable_timing=True)
                self._start.record()
            self.started_ = True

        def stop(self, reset: bool = False, record: bool = False) -> None:
            """End the interval (``reset`` and ``record`` are accepted and unused, as in DeepSpeed)."""
            if not self.started_:
                raise RuntimeError(f"{self.name_} timer is not started")
            if self.use_host_timer:
                seconds = time.time() - self._start
                self._intervals.append(lambda: seconds * 1000.0)
            else:
                begin, end = self._start, get_accelerator().Event(enable_timing=True)
                end.record()

                def read() -> float:
                    end.synchronize()
                    return float(begin.elapsed_time(end))

                self._intervals.append(read)
            self._start, self.started_ = None, False

        def reset(self) -> None:
            """Forget every interval (and one in progress)."""
            self.started_, self._start, self.elapsed_records = False, None, None
            self._intervals.clear()

        def elapsed(self, reset: bool = True) -> float:
            """Total milliseconds of the intervals; one in progress is ended first and restarted after."""
            running = self.started_
            if running:
                self.stop()
            self.elapsed_records = [read() for read in self._intervals]
            total = sum(self.elapsed_records)
            if reset:
                self.reset()
            if running:
                self.start()
            return total

        def mean(self) -> float:
            """The 10%-trimmed mean interval, in milliseconds (nothing is reset)."""
            self.elapsed(reset=False)
            return trim_mean(self.elapsed_records or [], 0.1)

    def __init__(self) -> None:
        self.timers: dict[str, SynchronizedWallClockTimer.Timer] = {}

    def get_timers(self) -> dict[str, SynchronizedWallClockTimer.Timer]:
        """The timers by name."""
        return self.timers

    def __call__(self, name: str) -> SynchronizedWallClockTimer.Timer:
        """The timer called ``name``, created on first use."""
        if name not in self.timers:
            self.timers[name] = self.Timer(name)
        return self.timers[name]

    @staticmethod
    def memory_usage() -> str:
        """`` | mem_allocated: X GB | max_mem_allocated: ... | cache_allocated: ... | max_cache_allocated: ...``."""
        acc = get_accelerator()
        gib = 1024**3
        return (f" | mem_allocated: {acc.memory_allocated() / gib:.4f} GB"
                f" | max_mem_allocated: {acc.max_memory_allocated() / gib:.4f} GB"
                f" | cache_allocated: {acc.memory_reserved() / gib:.4f} GB"
                f" | max_cache_allocated: {acc.max_memory_reserved() / gib:.4f} GB")

    def log(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True, memory_breakdown: bool = False,
            ranks: list[int] | None = None) -> None:
        """Print ``time (ms) | name: T | ...`` for the named timers that exist, each divided by
        ``normalizer``, on ``ranks`` (default rank 0). ``memory_breakdown`` is unused, as in DeepSpeed."""
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        line = "time (ms)"
        for name in names:
            if name in self.timers:
                line += f" | {name}: {self.timers[name].elapsed(reset=reset) / normalizer:.2f}"
        _print_on(line, ranks or [0])

    def get_mean(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True) -> dict[str, float]:
        """``{name: trimmed mean * 1000 / normalizer}`` for the named timers that exist.

        The scale is DeepSpeed's: its ``Timer.mean()`` is already in milliseconds and ``get_mean``
        multiplies it by 1000 again. ``reset`` is unused, as in DeepSpeed.
        """
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        return {name: self.timers[name].mean() * 1000.0 / normalizer for name in names if name in self.timers}


class NoopTimer:
    """DeepSpeed's stand-in for :class:`SynchronizedWallClockTimer` when timing is off: does nothing."""

    class Timer:
        """A timer that measures nothing."""

        def start(self) -> None:
            """Nothing."""

        def reset(self) -> None:
            """Nothing."""

        def stop(self, **kwargs: Any) -> None:
            """Nothing."""

        def elapsed(self, **kwargs: Any) -> float:
            """0."""
            return 0

        def mean(self) -> float:
            """0."""
            return 0

    def __init__(self) -> None:
        self.timer = self.Timer()

    def __call__(self, name: str) -> NoopTimer.Timer:
        return self.timer

    def get_timers(self) -> dict[str, Any]:
        """``{}``."""
        return {}

    def log(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True, memory_breakdown: bool = False,
            ranks: list[int] | None = None) -> None:
        """Nothing."""

    def get_mean(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True) -> None:
        """Nothing (``None``, as DeepSpeed's)."""


class ThroughputTimer:
    """Samples per second over training steps (DeepSpeed's ``ThroughputTimer``).

    Args:
        config: an object with ``enabled`` (time at all) and ``synchronized`` (synchronise the
            accelerator at each start and stop) attributes, as DeepSpeed's ``timers.throughput`` config.
        batch_size: samples per global step (``None``: 1).
        start_step: global steps left out of the averages (warm-up).
        steps_per_output: log every this many global steps (``None``: never).
        monitor_memory: also log the machine's memory and swap use (needs ``psutil``, as DeepSpeed).
        logging_fn: where the lines go (default: zeroshard's logger, at INFO).
    """

    def __init__(self, config: Any, batch_size: int | None, start_step: int = 2, steps_per_output: int | None = None,
                 monitor_memory: bool = False, logging_fn: Callable[[str], Any] | None = None) -> None:
        self.config = config
        self.start_time = 0.0
        self.end_time = 0.0
        self.started = False
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self.steps_per_output = steps_per_output
        self.monitor_memory = monitor_memory
        self.logging = logging_fn if logging_fn is not None else logger.info
        self.initialized = False
        if monitor_memory:
            try:
                import psutil  # noqa: F401
            except ImportError as e:
                raise ImportError("ThroughputTimer(monitor_memory=True) needs psutil: pip install psutil") from e

    def update_epoch_count(self) -> None:
        """A new epoch: count it and restart the micro-step count."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """Start timing a micro-step (from global step ``start_step`` on)."""
        if not self.config.enabled:
            return
        self.initialized = True
        self.started = True
        if self.global_step_count >= self.start_step:
            if self.config.synchronized:
                get_accelerator().synchronize()
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """End the micro-step; ``global_step`` when it completed an optimizer step (and maybe log)."""
        if not self.config.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time <= 0:
            return  # still warming up
        if self.config.synchronized:
            get_accelerator().synchronize()
        self.end_time = time.time()
        duration = self.end_time - self.start_time
        self.total_elapsed_time += duration
        self.step_elapsed_time += duration
        if not global_step:
            return
        if report_speed and self.steps_per_output is not None and self.global_step_count % self.steps_per_output == 0:
            acc = get_accelerator()
            self.logging(
                f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/global_step={self.global_step_count}, "
                f"RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
                f"CurrSamplesPerSec={self.batch_size / (self.step_elapsed_time + _EPSILON)}, "
                f"MemAllocated={round(acc.memory_allocated() / 1024**3, 2)}GB, "
                f"MaxMemAllocated={round(acc.max_memory_allocated() / 1024**3, 2)}GB")
            if self.monitor_memory:
                import psutil

                self.logging(f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
                             f"global_step={self.global_step_count}, vm %: {psutil.virtual_memory().percent}, "
                             f"swap %: {psutil.swap_memory().percent}")
        self.step_elapsed_time = 0

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed global steps (``-inf`` before the first one)."""
        timed_steps = self.global_step_count - self.start_step
        if self.global_step_count > 0 and timed_steps > 0 and self.total_elapsed_time > 0:
            return self.batch_size / (self.total_elapsed_time / timed_steps)
        return float("-inf")
