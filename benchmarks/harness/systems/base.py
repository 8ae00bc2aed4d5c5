"""What every system module provides, and the pieces they share (optimizer, config, torch loop)."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch

from benchmarks.harness.spec import Job
from benchmarks.harness.workload import MicroBatch, timed_census


class Phases:
    """Wall time spent in each phase of the current step: ``forward``, ``backward`` (with the
    gradient communication that backward hooks issue), ``optimizer`` (everything after the last
    backward: reduction at the boundary, clipping, the update, the parameter all-gather).

    CPU only: on CUDA the phases would need a synchronisation each, which changes what is measured.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = 0.0

    def start(self) -> None:
        """Begin a step."""
        self.seconds = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap to ``phase`` (unknown phases are dropped)."""
        now = time.perf_counter()
        if phase in self.seconds:
            self.seconds[phase] += now - self._last
        self._last = now


class NotAvailable(Exception):
    """The system cannot run this job (a feature not implemented yet, or unsupported here)."""


class Trainer(Protocol):
    """One optimizer step over a list of micro-batches."""

    phases: Phases
    """Per-phase wall time of the last step."""

    def train_step(self, micro: list[MicroBatch], measure: bool = False) -> tuple[float, dict[str, Any] | None]:
        """Forward/backward every micro-batch, clip to ``job.workload.clip``, step the optimizer.

        Returns this rank's mean loss and, when ``measure`` is set, the model-state bytes held
        after the last backward and before the optimizer step (gradients, parameters and the
        optimizer state from earlier steps all live then): ``{"total": bytes, "census_s": seconds
        the measurement took, ...}``.
        """
        ...


def adamw(params: Any, job: Job) -> torch.optim.Optimizer:
    """AdamW with the benchmark's hyperparameters and torch's fused kernel (CPU and CUDA)."""
    wl = job.workload
    return torch.optim.AdamW(params, lr=wl.lr, betas=wl.betas, eps=wl.eps, weight_decay=wl.weight_decay,
                             fused=True)


def deepspeed_config(job: Job) -> dict[str, Any]:
    """The DeepSpeed-schema config given to both zeroshard and DeepSpeed."""
    wl = job.workload
    zero: dict[str, Any] = {
        "stage": job.stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": wl.bucket_numel,
        "allgather_bucket_size": wl.bucket_numel,
    }
    if job.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if job.stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": wl.micro_batch,
        "gradient_accumulation_steps": wl.grad_accum,
        "gradient_clipping": wl.clip,
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": wl.lr, "betas": list(wl.betas), "eps": wl.eps, "weight_decay": wl.weight_decay,
                       "torch_adam": True, "fused": True},
        },
        "bf16": {"enabled": job.dtype == "bf16"},
        "zero_optimization": zero,
    }


class TorchLoop:
    """The plain-torch training step shared by DDP, ZeroRedundancyOptimizer and FSDP2."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, job: Job,
                 device: torch.device, ddp: bool = False) -> None:
        self.model = model
        self.optimizer = optimizer
        self.job = job
        self.ddp = ddp
        # DDP and ZeRO-R keep fp32 parameters and use autocast for bf16 (torch AMP); FSDP2 casts
        # its parameters itself through its MixedPrecisionPolicy.
        self.autocast = job.dtype == "bf16" and ddp

        self.device = device
        self.phases = Phases()

    def _context(self, last: bool) -> AbstractContextManager[Any]:
        if self.ddp and not last:
            return self.model.no_sync()  # type: ignore[operator]
        return nullcontext()

    def train_step(self, micro: list[MicroBatch], measure: bool = False) -> tuple[float, dict[str, Any] | None]:
        """See :class:`Trainer`."""
        total = 0.0
        n = len(micro)
        self.phases.start()
        for i, (x, y) in enumerate(micro):
            with self._context(i == n - 1):
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                    loss = self.model(x, y)
                self.phases.lap("forward")
                (loss / n).backward()
                self.phases.lap("backward")
            total += float(loss.detach())
        state = None
        if measure:
            state = timed_census([self.model, self.optimizer])
            state["total"] = state["census"]
            self.phases.lap("census")
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.job.workload.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.phases.lap("optimizer")
        return total / n, state
