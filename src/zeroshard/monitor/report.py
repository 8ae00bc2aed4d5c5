"""The training report: the progress line every ``steps_per_print`` steps and the monitors' scalars.

The engine hands each optimizer step's numbers to :class:`Reporter` (:meth:`Reporter.step_done`).
What is cheap stays on the host (lr, loss scale, gradient norm, timer totals); the loss stays on
the device, so a step costs no synchronisation. Rank 0 writes the host numbers to the monitors at
every step, as DeepSpeed does. Every ``interval`` steps one all-reduce averages the per-step
losses over the ranks and sums the tokens seen (one collective and one host sync per interval),
then rank 0 logs the line and writes the interval's losses (each at its own step) and throughput:
the losses of steps after the last full interval are not written (every rank would have to join
a collective at the end). The interval is ``steps_per_print``; without it, 1 when
``wall_clock_breakdown`` or a monitor asks for output (DeepSpeed writes and prints those every
step). Every rank takes the same decision from the same config, so the collective matches.

Monitor tags are DeepSpeed's, with the global sample count as the x-axis: ``Train/Samples/
train_loss``, ``lr`` (first param group), ``loss_scale`` (fp16 only), and with
``wall_clock_breakdown`` ``elapsed_time_ms_forward``, ``_backward``, ``_backward_inner``,
``_backward_allreduce``, ``_step`` (milliseconds in that optimizer step). zeroshard adds
``grad_norm`` (applied steps), ``elapsed_time_ms_gather`` (ZeRO-3), and once per interval
``samples_per_sec`` and ``tokens_per_sec`` (when tokens are known).

Tokens: a training forward whose ``input_ids`` keyword, ``batch["input_ids"]`` (first argument a
mapping) or first argument (an integer tensor of at least 2 dimensions: batch x sequence) is a
tensor counts its elements; set :attr:`Reporter.tokens_per_sample` to count
``samples x tokens_per_sample`` instead (inputs the rule does not recognise, or padding to exclude).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

from zeroshard.core.comm import collectives as C
from zeroshard.core.precision import LossScaler
from zeroshard.monitor import memory
from zeroshard.monitor.base import Event
from zeroshard.monitor.master import MonitorMaster
from zeroshard.monitor.timers import WallClockTimers

logger = logging.getLogger("zeroshard")

TAG = "Train/Samples/"
#: timer names the engine uses -> DeepSpeed's ``elapsed_time_ms_*`` tag suffixes (``backward`` is
#: the sum of inner and allreduce, as DeepSpeed's outer backward timer).
TIMER_TAGS = {"forward": "forward", "backward": "backward_inner", "reduce": "backward_allreduce",
              "step": "step", "gather": "gather"}


class TrainingState(Protocol):
    """What the reporter reads from the engine after a step."""

    global_steps: int
    global_samples: int
    skipped_steps: int

    @property
    def scaler(self) -> LossScaler: ...

    def get_lr(self) -> list[float]: ...

    def get_global_grad_norm(self) -> float | None: ...


def count_tokens(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """Tokens in one forward's inputs by the module doc's rule (0 when not recognised)."""
    ids = kwargs.get("input_ids")
    if ids is None and args:
        first = args[0]
        ids = first.get("input_ids") if isinstance(first, Mapping) else first
        if isinstance(ids, torch.Tensor) and ids is first and ids.dim() < 2:
            return 0
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        return 0
    return ids.numel()


class Reporter:
    """Collects per-step numbers; every ``interval`` steps logs the line and writes the monitors."""

    def __init__(self, config: Any, group: dist.ProcessGroup | None, device: torch.device,
                 timers: WallClockTimers, monitor: MonitorMaster) -> None:
        self.group = group
        self.rank = C.rank(group)
        self.device = device
        self.timers = timers
        self.monitor = monitor
        self.fp16 = bool(config.fp16.enabled)
        self.train_batch_size = int(config.train_batch_size)
        self.print_lines = config.steps_per_print is not None or timers.enabled
        every = config.steps_per_print or (1 if timers.enabled or monitor.enabled else None)
        #: steps between reports (``None``: never report; then nothing is recorded)
        self.interval: int | None = int(every) if every else None
        #: tokens per sample, overriding the count from the inputs (see the module doc)
        self.tokens_per_sample: int | None = None
        self._tokens = 0
        self._steps: list[tuple[int, torch.Tensor]] = []  # (x, loss on the device) since the last report
        self._window_timers: dict[str, float] = {}
        self._last_time = time.perf_counter()

    @property
    def active(self) -> bool:
        """Whether anything is reported (else :meth:`step_done` need not be called)."""
        return self.interval is not None

    def count_forward(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """Count a training forward's tokens (no-op when inactive, under ``no_grad`` or with a hint)."""
        if self.interval is not None and self.tokens_per_sample is None and torch.is_grad_enabled():
            self._tokens += count_tokens(args, kwargs)

    def step_done(self, engine: TrainingState, loss: torch.Tensor, applied: bool) -> None:
        """Record one optimizer step (``loss``: its mean loss on this rank, on the device)."""
        if self.interval is None:
            return
        x = engine.global_samples
        events: list[Event] = [(TAG + "lr", engine.get_lr()[0], x)]
        if self.fp16:
            events.append((TAG + "loss_scale", float(engine.scaler.scale), x))
        norm = engine.get_global_grad_norm()
        if applied and norm is not None:
            events.append((TAG + "grad_norm", norm, x))
        if self.timers.enabled:
            events += self._timer_events(x)
        if self.rank == 0 and self.monitor.enabled:  # host numbers: written now, as DeepSpeed writes each step's
            self.monitor.write_events(events)
            self.monitor.flush()
        self._steps.append((x, loss.detach().float().reshape(())))
        if engine.global_steps % self.interval == 0:
            self._report(engine)

    def _timer_events(self, x: int) -> list[Event]:
        step = dict(self.timers.totals)
        self.timers.reset()
        for name, seconds in step.items():
            self._window_timers[name] = self._window_timers.get(name, 0.0) + seconds
        ms = {name: 1000 * step.get(name, 0.0) for name in TIMER_TAGS}
        out = [(TAG + "elapsed_time_ms_backward", ms["backward"] + ms["reduce"], x)]
        out += [(TAG + "elapsed_time_ms_" + tag, ms[name], x) for name, tag in TIMER_TAGS.items()
                if name != "gather" or name in step]
        return out

    def _report(self, engine: TrainingState) -> None:
        """The interval's one collective, then rank 0's line and monitor writes."""
        world = C.world_size(self.group)
        control = C.control_device(self.group)
        values = torch.cat([torch.stack([loss for _, loss in self._steps]).to(control, torch.float64),
                            torch.tensor([float(self._tokens)], dtype=torch.float64, device=control)])
        C.all_reduce(values, self.group, async_op=False)
        *losses, total_tokens = values.tolist()
        losses = [v / world for v in losses]
        if self.tokens_per_sample is not None:
            total_tokens = float(self.tokens_per_sample * self.train_batch_size * len(self._steps))
        if self.rank == 0:
            with C.on_ranks([0], "writing the training report, which runs on rank 0 only", self.group):
                self._write(engine, losses, total_tokens)
        self._steps.clear()
        self._tokens = 0
        self._window_timers.clear()
        self._last_time = time.perf_counter()

    def _write(self, engine: TrainingState, losses: list[float], tokens: float) -> None:
        n = len(self._steps)
        elapsed = max(time.perf_counter() - self._last_time, 1e-9)
        samples_per_s = n * self.train_batch_size / elapsed
        tokens_per_s = tokens / elapsed if tokens > 0 else None
        x = engine.global_samples
        events: list[Event] = []
        for (sx, _), value in zip(self._steps, losses):
            events.append((TAG + "train_loss", value, sx))
        events.append((TAG + "samples_per_sec", samples_per_s, x))
        if tokens_per_s is not None:
            events.append((TAG + "tokens_per_sec", tokens_per_s, x))
        self.monitor.write_events(events)
        self.monitor.flush()
        if self.print_lines:
            logger.info("%s", self._line(engine, sum(losses) / n, 1000 * elapsed / n, samples_per_s, tokens_per_s, n))

    def _line(self, engine: TrainingState, loss: float, step_ms: float, samples_per_s: float,
              tokens_per_s: float | None, n: int) -> str:
        lrs = engine.get_lr()
        lr = f"{lrs[0]:.3e}" if len(set(lrs)) == 1 else "[" + ", ".join(f"{v:.3e}" for v in lrs) + "]"
        norm = engine.get_global_grad_norm()
        parts = [f"step={engine.global_steps}", f"samples={engine.global_samples}", f"loss={loss:.4f}",
                 f"lr={lr}", f"loss_scale={float(engine.scaler.scale):g}",
                 f"grad_norm={norm:.4g}" if norm is not None else "grad_norm=n/a",
                 f"skipped={engine.skipped_steps}", f"step_time={step_ms:.1f}ms", f"samples/s={samples_per_s:.1f}"]
        if tokens_per_s is not None:
            parts.append(f"tokens/s={tokens_per_s:,.0f}")
        parts.append("mem: " + memory.describe(memory.sample(self.device)))
        line = " ".join(parts)
        if self._window_timers:
            line += " | ms/step: " + " ".join(f"{name}={1000 * self._window_timers[name] / n:.1f}"
                                              for name in TIMER_TAGS if name in self._window_timers)
        return line
