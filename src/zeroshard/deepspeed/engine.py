"""``ZeroEngine``: the engine ``initialize`` returns, zeroshard's :class:`~zeroshard.engine.Engine`
with DeepSpeed's engine methods (:mod:`zeroshard.deepspeed.engine_api`) and its throughput timer.

DeepSpeed's ``DeepSpeedEngine`` is this class (``zeroshard.deepspeed.imports`` answers the name).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zeroshard.core.clock import StepClock
from zeroshard.core.precision import PrecisionPolicy
from zeroshard.core.zero_optimizer import ZeroOptimizer
from zeroshard.deepspeed.engine_api import DeepSpeedEngineAPI
from zeroshard.deepspeed.offload_states import EngineStateOffload
from zeroshard.deepspeed.timers import ThroughputTimer
from zeroshard.engine import Engine

__all__ = ["ZeroEngine"]


class ZeroEngine(DeepSpeedEngineAPI, EngineStateOffload, Engine):
    """zeroshard's engine under DeepSpeed's API: ``engine(batch)``, ``engine.backward(loss)``,
    ``engine.step()``, and the 180 public methods and properties of DeepSpeed 0.19.8's engine
    (those not supported yet raise ``NotYetSupportedError`` naming the reason)."""

    def __init__(self, module: torch.nn.Module, optimizer: ZeroOptimizer, config: Any,
                 policy: PrecisionPolicy, lr_scheduler: Any, group: dist.ProcessGroup | None,
                 clock: StepClock | None = None) -> None:
        super().__init__(module, optimizer, config, policy, lr_scheduler, group, clock)
        #: DeepSpeed's throughput timer (``timers.throughput``), which scripts read and drive
        #: (``update_epoch_count()``, ``avg_samples_per_sec()``); it never logs: the step log reports throughput
        self.tput_timer = ThroughputTimer(config.timers.throughput, batch_size=self.train_batch_size())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The engine's forward; DeepSpeed's throughput timer starts here (DeepSpeed's data loader
        starts it when it has one: data loading counts there)."""
        self.tput_timer.start()
        return super().forward(*args, **kwargs)

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """The engine's step; DeepSpeed's throughput timer stops here, counting a step at boundaries."""
        if not self.window.no_sync:  # inside no_sync() the step refuses before anything counts
            self.tput_timer.stop(global_step=self.window.is_boundary(), report_speed=False)
        super().step(lr_kwargs)
