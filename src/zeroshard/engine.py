"""The training engine: forward, backward, step, checkpoints.

The engine drives a stage built by :mod:`zeroshard.core.build` (reached through
:class:`zeroshard.core.seam.Stage`), a precision policy and the accumulation window
(:class:`zeroshard.window.AccumulationWindow`). It holds no sharding logic of its own: ``backward``
brackets autograd with the stage's gradient sync, and ``step`` calls the stage at accumulation
boundaries. DeepSpeed's other engine methods are added by :class:`zeroshard.deepspeed.engine.ZeroEngine`,
the class ``initialize`` returns.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.core.clock import StepClock
from zeroshard.core.comm import agreement
from zeroshard.core.comm import collectives as C
from zeroshard.core.comm.groups import local_rank
from zeroshard.core.comm.watchdog import guarded
from zeroshard.core.precision import LossScaler, PrecisionPolicy
from zeroshard.core.zero_optimizer import ZeroOptimizer
from zeroshard.monitor import MonitorMaster, Reporter
from zeroshard.monitor.comms import CommsLogger
from zeroshard.monitor.gather_timing import time_forward_gathers
from zeroshard.monitor.timers import WallClockTimers
from zeroshard.optim.no_optimizer import NoOptimizer
from zeroshard.profiling import FlopsProfiler, RunInfo
from zeroshard.step_checks import check_stray_gradients, check_unused_parameters, warn_unfrozen
from zeroshard.window import AccumulationWindow

logger = logging.getLogger("zeroshard")


def _window_field(name: str, doc: str) -> Any:
    """A counter of the engine's :class:`~zeroshard.window.AccumulationWindow`, under its DeepSpeed name."""
    return property(lambda self: getattr(self.window, name), lambda self, v: setattr(self.window, name, v), doc=doc)


class Engine(torch.nn.Module):
    """Wraps a module for sharded, mixed-precision data-parallel training.

    Built by :func:`zeroshard.initialize` (as its subclass with DeepSpeed's methods,
    :class:`zeroshard.ZeroEngine`); use ``engine(batch)``, ``engine.backward(loss)`` and
    ``engine.step()`` exactly as with DeepSpeed's engine.
    """

    def __getattr__(self, name: str) -> Any:
        """An attribute the engine does not have is the model's, as in DeepSpeed: scripts call
        ``engine.gradient_checkpointing_enable()``, read ``engine.config`` of a Hugging Face model
        (the engine's own ``config`` wins) or reach ``engine.model``."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
            try:
                return getattr(module, name)
            except AttributeError:
                raise AttributeError(f"neither the {type(self).__name__} nor its module ({type(module).__name__}) "
                                     f"has an attribute {name!r}") from None

    def __init__(self, module: torch.nn.Module, optimizer: ZeroOptimizer, config: Any,
                 policy: PrecisionPolicy, lr_scheduler: Any, group: dist.ProcessGroup | None,
                 clock: StepClock | None = None) -> None:
        super().__init__()
        self.module = module
        self.optimizer = optimizer
        self.config = config
        self.policy = policy
        self.lr_scheduler = lr_scheduler
        self.group = group
        self.device = next((p.device for p in module.parameters()), torch.device("cpu"))
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = C.world_size(group)
        self.local_rank = local_rank()
        #: the accumulation window: counters, boundary, the window's forwards, backwards and losses
        self.window = AccumulationWindow(self.gradient_accumulation_steps, clock or StepClock(), self.device)
        self._frozen_at_initialize = [(n, p) for n, p in module.named_parameters()
                                      if p not in optimizer.master.views and not p.requires_grad]
        self.timers = WallClockTimers(enabled=bool(config.wall_clock_breakdown), device=self.device)
        #: ZeRO-3's parameter coordinator (``None`` at stages 0-2)
        self._coordinator = optimizer.coordinator
        if self._coordinator is not None:
            time_forward_gathers(list(self._coordinator.module_units), self.timers)
        #: the config's monitors (TensorBoard, CSV, W&B, Comet); they write from rank 0
        self.monitor = MonitorMaster(config, self.global_rank)
        #: the progress line and the monitors' scalars; ``reporter.tokens_per_sample`` overrides the
        #: token count taken from the inputs (:mod:`zeroshard.monitor.report`)
        self.reporter = Reporter(config, group, self.device, self.timers, self.monitor)
        #: ``comms_logger``: counts and times every collective of the process (``comms_summary()``)
        self.comms_logger = (CommsLogger(config.comms_logger, self.global_rank, self.world_size).install()
                             if config.comms_logger.enabled else None)
        #: ``flops_profiler``: the forwards of step ``profile_step``, on rank 0 (as DeepSpeed)
        self.flops_profiler = (FlopsProfiler(module, config.flops_profiler, RunInfo(
            self.world_size, self.train_micro_batch_size_per_gpu(), self.device, policy.param_dtype))
            if config.flops_profiler.enabled and self.global_rank == 0 else None)

    # -- DeepSpeed accessors ---------------------------------------------------------------------
    @property
    def scaler(self) -> LossScaler:
        """The fp16 loss scaler (a constant 1.0 scaler otherwise)."""
        return self.optimizer.scaler

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage in use."""
        return int(self.optimizer.spec.stage)

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all ranks."""
        return int(self.config.train_batch_size or 0)

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per rank per micro-step."""
        return int(self.config.train_micro_batch_size_per_gpu or 0)

    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step."""
        return int(self.config.gradient_accumulation_steps or 0)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step ends an accumulation window (the next ``step`` updates): the
        value of :meth:`set_gradient_accumulation_boundary` once called, else the micro-step count."""
        return self.window.is_boundary()

    # DeepSpeed's counters on the engine, read (and by checkpoint loading, written) through the window
    global_steps = _window_field("global_steps", "Optimizer steps taken (applied or skipped).")
    micro_steps = _window_field("micro_steps", "Micro-steps (``step()`` calls) since training began.")
    global_samples = _window_field("global_samples", "Samples trained on, over all ranks.")
    skipped_steps = _window_field("skipped_steps", "Optimizer steps skipped for non-finite gradients.")

    def get_lr(self) -> list[float]:
        """Current learning rate of each param group."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """Global gradient norm (unscaled, before clipping) of the last step; ``inf`` when it was skipped
        for non-finite gradients (as DeepSpeed); ``None`` before the first step."""
        return self.optimizer.global_grad_norm

    def memory_usage(self) -> dict[str, int]:
        """Bytes this rank holds (DeepSpeed's ``memory_breakdown()`` is the config flag):
        ``parameters`` (module tensors materialized now), ``gradients``,
        ``master_weights``, ``optimizer_states``, under ZeRO-3 ``parameter_shard`` (a compute-dtype shard
        at rest), ``frozen_parameter_shard`` (the chunks of parameters that are not trained) and
        ``gathered_peak`` (most gathered parameter bytes seen at once),
        ``comm_workspace`` (reused communication buffers, bounded by the bucket sizes), and
        ``total`` (the model state: peaks and workspace excluded). Bytes in NVMe swap files are not held:
        ``optimizer.memory_placement()`` lists them under ``file``."""
        params = sum(p.numel() * p.element_size() for p in self.module.parameters())
        out = {"parameters": params, **self.optimizer.memory_breakdown()}
        out["total"] = sum(v for k, v in out.items() if not k.endswith(("_peak", "_workspace")))
        return out

    def comms_summary(self, print_log: bool = True, reset: bool = False) -> dict[str, Any]:
        """The communication logger's summary for this rank (``comms_logger`` must be enabled):
        DeepSpeed's ``deepspeed.comm.log_summary(return_dict=True)`` dictionary, per op and message
        size: count, total and mean latency (ms), algorithm and bus bandwidth (Gbps). With
        ``print_log`` rank 0 logs DeepSpeed's table; ``reset`` starts counting afresh."""
        if self.comms_logger is None:
            from zeroshard.errors import ConfigError

            raise ConfigError("comms_summary() needs the communication logger: set it to true",
                              key="comms_logger.enabled")
        return self.comms_logger.summary(print_log, reset)

    def gathered(self, enabled: bool = True) -> Any:
        """Keep every parameter gathered for the block (ZeRO-3; a no-op otherwise).

        For loops of many small forwards (``generate``): without it each forward gathers each
        unit again. It costs the full model's parameters in the compute dtype on every rank for
        the duration of the block; modifications made inside are discarded (use
        ``zeroshard.zero.GatheredParameters(..., modifier_rank=r)`` to keep them).
        """
        from zeroshard.zero import GatheredParameters

        return GatheredParameters(list(self.module.parameters()), enabled=enabled)

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the full weights (compute dtype) as one safetensors file from rank 0.

        Under ZeRO-3 the units are gathered one at a time while streaming, whatever
        ``stage3_gather_16bit_weights_on_model_save`` says (DeepSpeed refuses to save without it;
        here gathering costs one unit of memory, so there is no reason to). Returns ``True``.
        """
        from zeroshard.zero.export import save_16bit_model

        save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)
        return True

    # -- training ----------------------------------------------------------------------------------
    @guarded("forward of step {step}")
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module, casting floating-point inputs to the compute dtype (``auto_cast``)."""
        args = self.policy.cast_inputs(args)  # type: ignore[assignment]
        kwargs = self.policy.cast_inputs(kwargs)  # type: ignore[assignment]
        if self._coordinator is not None:
            self._coordinator.start_pass()
            if torch.is_grad_enabled():
                self.window.forwards += 1  # stages 0-2 may run forwards on some ranks only (no collectives)
        self.reporter.count_forward(args, kwargs)
        profiled = self.flops_profiler.forward(self.global_steps) if self.flops_profiler is not None else nullcontext()
        with self.timers("forward"), profiled:
            return self.module(*args, **kwargs)

    @guarded("backward of step {step}")
    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate ``loss``: divided by the accumulation steps and multiplied by the fp16 scale.

        Returns the loss divided by the accumulation steps (with ``scale_wrt_gas``), as DeepSpeed;
        the engine logs the loss as given. Inside :meth:`no_sync` gradients are not reduced.
        """
        self.window.add_loss(loss)
        # under the caller's no_grad too: loss.backward() works there in plain PyTorch, as the loss's graph exists
        with torch.enable_grad():
            gas_scaled = loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss
            scaled = gas_scaled
            if self.scaler.scale != 1.0:
                scaled = scaled.float() * self.scaler.scale
        boundary = self.window.is_boundary() and not self.window.no_sync
        if boundary or self.optimizer.sync.reduces_every_micro_step:  # before this backward reduces anything
            self._check_agreement()
        self.window.backwards += 1
        with self.timers("backward"):
            self.optimizer.start_backward(boundary)
            scaled.backward(retain_graph=retain_graph)
        with self.timers("reduce"):  # the gradient communication that backward did not overlap
            self.optimizer.finish_backward()
        return gas_scaled

    def _check_agreement(self, kind: int = agreement.BACKWARD) -> None:
        """Before this backward reduces gradients (or a checkpoint is saved): every rank is at the
        same micro-step and ran as many forwards and backwards (and under ZeRO-3 gathered the same
        units) in this window (:mod:`zeroshard.core.comm.agreement`)."""
        co = self._coordinator
        w = self.window
        ga = w.accumulation_steps
        values = [w.global_steps, w.position, w.forwards, w.backwards, co.window_hash if co is not None else 0]
        where = f"micro-step {w.position + 1} of {ga} of optimizer step {self.global_steps}"
        if kind == agreement.SAVE:
            where = f"save_checkpoint after optimizer step {self.global_steps}"
        agreement.check(values, self.group, where, co.window_log if co is not None else None,
                        co.unit_names if co is not None else None, kind=kind, ga=ga)

    @guarded("optimizer step {step}")
    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """At an accumulation boundary: reduce, unscale, clip, step the optimizer and scheduler
        (``lr_scheduler.step(**lr_kwargs)``, as DeepSpeed).

        Between boundaries it only counts the micro-step.
        """
        w = self.window
        if w.no_sync:
            raise RuntimeError("engine.step() inside no_sync() is illegal (as in DeepSpeed): leave the block first")
        w.step_applied = False
        if isinstance(self.optimizer.optimizer, NoOptimizer):
            # An evaluation engine refuses here, at every micro-step: with nothing trained (a model
            # frozen whole) the optimizer step below would never call it.
            self.optimizer.optimizer.step()
        boundary = w.is_boundary()
        if boundary and w.first_extra_step():  # DeepSpeed is silent: the window ends early, on fewer gradients
            logger.warning("engine.step() was called %d times for %d engine.backward() calls in this accumulation "
                           "window of %d micro-steps: each step() call counts one micro-step, so the optimizer "
                           "steps on fewer micro-batches than gradient_accumulation_steps says. Call "
                           "engine.step() once after each engine.backward(loss)", w.step_calls(),
                           w.backwards, w.accumulation_steps)
        if not boundary:
            w.count_micro_step()
            return
        w.close()  # its counters start the next window
        if self._coordinator is not None:
            self._coordinator.new_window()
        check_stray_gradients(self.module, self.optimizer.sync)
        if not self.config.zero_optimization.ignore_unused_parameters:
            check_unused_parameters(self.module, self.optimizer.sync)
        if self._frozen_at_initialize and warn_unfrozen(self._frozen_at_initialize, self.global_rank):
            self._frozen_at_initialize = []  # said once
        self._log_memory("before step")
        with self.timers("step"):
            try:
                applied = self.optimizer.step(by_engine=True)
            except FloatingPointError as e:  # fp16 overflow at the minimum loss scale
                raise FloatingPointError(f"optimizer step {self.global_steps}: {e}{self._culprit()}") from None
        if applied and self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        if not applied and not getattr(self.scaler, "dynamic", False):  # fp16's dynamic scaler reports its own
            self._non_finite()
        w.stepped(bool(applied), self.train_batch_size())
        self._report(applied)
        if self.flops_profiler is not None:
            self.flops_profiler.step_done(self.global_steps - 1)  # reports the profiled step

    def _log_memory(self, where: str) -> None:
        """``memory_breakdown: true``: log this rank's bytes at points of the step (rank 0)."""
        if self.config.memory_breakdown and self.global_rank == 0:
            logger.info("zeroshard: memory %s: %s", where,
                        " ".join(f"{k}={v / 2**20:.1f}MiB" for k, v in self.memory_usage().items()))

    def _new_window(self) -> None:
        self.window.restart()
        if self._coordinator is not None:
            self._coordinator.new_window()

    def _culprit(self) -> str:
        p = getattr(self.optimizer, "nonfinite_param", None)
        if p is None:
            return ""
        name = next((n for n, q in self.module.named_parameters() if q is p), "?")
        return f" (the first parameter with a NaN or Inf gradient: {name})"

    def _non_finite(self) -> None:
        """A NaN or Inf gradient without dynamic loss scaling: skip the step with a warning, or
        raise (``non_finite_gradients``). Every rank sees the same all-reduced norm, so every rank
        takes the same decision."""
        text = (f"optimizer step {self.global_steps}: the gradient norm is not finite{self._culprit()}, so the "
                "step was skipped. A NaN or Inf loss, a learning rate too high for the model, or fp16 without "
                "dynamic loss scaling cause this; a lower learning rate, gradient clipping or bf16 usually help")
        if self.config.non_finite_gradients == "raise":
            raise FloatingPointError(text + " (non_finite_gradients: raise)")
        if self.global_rank == 0:
            logger.warning("%s (set non_finite_gradients: raise to stop instead)", text)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget accumulated gradients (the engine already does after every step), and any ``.grad``
        a backward outside ``engine.backward`` left on the trained parameters (as DeepSpeed's)."""
        self.optimizer.zero_grad()
        for p in self.optimizer.sync.stray_grads():
            p.grad = None

    def _report(self, applied: bool) -> None:
        """After each optimizer step: its mean loss (on the device) and numbers go to the reporter,
        which logs every ``steps_per_print`` steps and feeds the monitors."""
        if self.reporter.active:
            self.reporter.step_done(self, self.window.mean_loss(), applied)
        self.window.clear_losses()

    # -- checkpoints (implemented in zeroshard.checkpoint) -----------------------------------------
    @property
    def training_dataloader(self) -> Any:
        """The data loader ``initialize(training_data=...)`` built for this engine (or one assigned
        here); checkpoints save and restore its position."""
        return self.__dict__.get("_training_dataloader")

    @training_dataloader.setter
    def training_dataloader(self, loader: Any) -> None:
        self.__dict__["_training_dataloader"] = loader

    @property
    def collate_fn(self) -> Any:
        """The ``collate_fn`` given to ``initialize``: :meth:`deepspeed_io`'s default, as in DeepSpeed."""
        return self.__dict__.get("_collate_fn")

    @collate_fn.setter
    def collate_fn(self, fn: Any) -> None:
        self.__dict__["_collate_fn"] = fn

    @guarded("save_checkpoint after step {step}")
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Save a sharded, crash-safe checkpoint to ``save_dir/<tag>`` (DeepSpeed's semantics).

        Collective: call on every rank. ``tag`` defaults to ``global_step<N>``; ``client_state``
        (plain data and tensors) comes back from :meth:`load_checkpoint`; ``latest`` names the tag
        when ``save_latest``. See :mod:`zeroshard.checkpoint`.
        """
        from zeroshard.checkpoint.save import save_checkpoint

        self._check_agreement(agreement.SAVE)  # a rank with an extra micro-step would save another window
        return save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    @guarded("load_checkpoint")
    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[str | None, Any]:
        """Load a zeroshard or DeepSpeed checkpoint saved at any world size and stage.

        Collective. ``tag`` defaults to the one named by ``load_dir/latest``. Returns
        ``(checkpoint path, client_state)``, or ``(None, None)`` without a ``latest`` file.
        """
        if custom_load_fn is not None:
            from zeroshard.errors import NotYetSupportedError

            raise NotYetSupportedError("load_checkpoint(custom_load_fn=...) is not supported", key="custom_load_fn")
        from zeroshard.checkpoint.load import load_checkpoint

        result = load_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states,
                                 load_lr_scheduler_states, load_module_only)
        if result[0] is not None:
            # The loaded step starts a whole window (see checkpoint/load.py): gradients and losses of a
            # window in progress here belong to the training being replaced, not to the first step after it.
            self.zero_grad()
            self.window.clear_losses()
        self._new_window()
        return result
