"""DeepSpeed's engine methods that act on training state: ``no_sync``, batch-size changes,
``was_step_applied``, optimizer queries, module state dicts, ``deepspeed_io``, ``destroy``.

The engine (:class:`zeroshard.deepspeed.engine.ZeroEngine`) inherits them; ``forward``/``backward``/``step``
stay in ``engine.py``; the state these methods read and change is the engine's accumulation window
(:class:`zeroshard.window.AccumulationWindow`).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.config.schema import ZeroshardConfig
from zeroshard.core.comm import collectives as C
from zeroshard.errors import ConfigError, NotYetSupportedError
from zeroshard.window import AccumulationWindow

logger = logging.getLogger("zeroshard")


class TrainingAPI:
    """Training-state methods with DeepSpeed's names and semantics."""

    config: ZeroshardConfig
    optimizer: Any
    module: torch.nn.Module
    group: dist.ProcessGroup | None
    world_size: int
    global_rank: int
    local_rank: int
    window: AccumulationWindow
    timers: Any
    training_dataloader: Any

    @property
    def inside_no_sync_ctxt(self) -> bool:
        """True inside :meth:`no_sync` (DeepSpeed's attribute name)."""
        return self.window.no_sync

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Say by hand whether the coming backward and ``step()`` end an accumulation window (DeepSpeed's).

        From the first call on, :meth:`is_gradient_accumulation_boundary` returns the value set last
        instead of counting micro-steps: accelerate sets it before every backward and calls ``step()``
        only at the boundary. A boundary ``step()`` then starts a new window of the counter, so the
        checkpoint and batch-size checks of window starts still hold.
        """
        self.window.boundary_override = bool(is_boundary)

    # -- no_sync --------------------------------------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside the block accumulate gradients locally without reducing them.

        DeepSpeed's rule: not with ZeRO stage 2 or 3 (they reduce and partition gradients in every
        backward), no re-entry, and no ``step()`` inside. The next backward outside the block at an
        accumulation boundary reduces everything accumulated.
        """
        stage = int(self.config.zero_stage)
        if stage >= 2:
            raise ConfigError(f"no_sync() is incompatible with ZeRO stage {stage}: stages 2 and 3 reduce and "
                              "partition gradients in every backward (as in DeepSpeed); use stage 0 or 1, or "
                              "gradient_accumulation_steps", key="zero_optimization.stage")
        if self.window.no_sync:
            raise RuntimeError("no_sync() context manager re-entry is unsupported")
        self.window.no_sync = True
        try:
            yield
        finally:
            self.window.no_sync = False

    # -- batch size -------------------------------------------------------------------------------
    def _require_window_start(self, what: str) -> None:
        position = self.window.position
        if position:
            raise RuntimeError(f"{what} in the middle of an accumulation window (micro-step {position} "
                               f"of {self.window.accumulation_steps}): call it right after engine.step() at a boundary")

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch size by changing the accumulation steps (micro batch kept).

        Raises:
            ValueError: ``train_batch_size`` is not a multiple of micro batch × world size.
            RuntimeError: called in the middle of an accumulation window.
        """
        micro = int(self.config.train_micro_batch_size_per_gpu or 1)
        if train_batch_size % (micro * self.world_size) != 0:
            raise ValueError("Train batch size must be divisible by micro-batch data parallelism "
                             f"({micro} x {self.world_size} ranks); got {train_batch_size}")
        self._require_window_start("set_train_batch_size()")
        self.config.train_batch_size = train_batch_size
        self.config.gradient_accumulation_steps = train_batch_size // (micro * self.world_size)
        self.window.recount_from_steps()

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro batch; the global batch follows (accumulation steps kept). The data loader
        is not rebuilt (as in DeepSpeed): give it batches of the new size."""
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
        self._require_window_start("set_train_micro_batch_size()")
        ga = int(self.config.gradient_accumulation_steps or 1)
        self.config.train_batch_size = micro_batch_size * ga * self.world_size
        self.config.train_micro_batch_size_per_gpu = micro_batch_size

    def was_step_applied(self) -> bool:
        """Whether the latest ``step()`` updated the parameters (False between boundaries and after a
        skipped overflow step)."""
        return self.window.step_applied

    # -- optimizer queries ---------------------------------------------------------------------------
    def _get_optimizer_param(self, name: str) -> list[Any]:
        return [g.get(name, 0.0) for g in self.optimizer.param_groups]

    def get_type(self) -> list[Any]:
        """Each param group's ``type`` entry (0.0 where absent), as DeepSpeed."""
        return self._get_optimizer_param("type")

    def get_mom(self) -> list[Any]:
        """Each param group's ``momentum`` (SGD, RMSprop) or ``betas`` (others)."""
        name = "momentum" if self.optimizer_name() in ("SGD", "RMSprop") else "betas"
        return self._get_optimizer_param(name)

    def optimizer_name(self) -> str | None:
        """The client optimizer's class name, or the config's ``optimizer.type``."""
        if self.config.optimizer is not None:
            return self.config.optimizer.type
        inner = getattr(self.optimizer, "optimizer", None)
        return type(inner).__name__ if inner is not None else None

    @property
    def cur_scale(self) -> float:
        """The loss scale in use now (1.0 unless fp16): ``engine.optimizer.cur_scale``, DeepSpeed's name."""
        return self.optimizer.cur_scale

    # -- ranks ---------------------------------------------------------------------------------------
    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks (all ranks: no model parallelism)."""
        return self.world_size

    @property
    def mp_world_size(self) -> int:
        """Model-parallel ranks: 1."""
        return 1

    def get_data_parallel_rank(self) -> int:
        """This rank in the data-parallel group."""
        return C.rank(self.group)

    def get_tensor_parallel_rank(self) -> int:
        """0: no tensor parallelism."""
        return 0

    def get_model_parallel_rank(self) -> int:
        """0: no model parallelism."""
        return 0

    def all_gather_scalar(self, value: torch.Tensor, dp_group: dist.ProcessGroup | None) -> list[torch.Tensor]:
        """Every rank's ``value``, in rank order (collective)."""
        out = [torch.zeros_like(value) for _ in range(C.world_size(dp_group))]
        if len(out) == 1:
            out[0].copy_(value)
        else:
            dist.all_gather(out, value, group=dp_group)
        return out

    # -- module state ----------------------------------------------------------------------------------
    def module_state_dict(self, destination: dict[str, Any] | None = None, prefix: str = "",
                          keep_vars: bool = False, exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """The module's state dict (full tensors; under ZeRO-3 a collective gather, unit by unit)."""
        sd: dict[str, Any] = self.module.state_dict(destination=destination, prefix=prefix,  # type: ignore[type-var,arg-type]
                                                    keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters():
                if not p.requires_grad:
                    sd.pop(prefix + name, None)
        return sd

    def load_module_state_dict(self, checkpoint: dict[str, Any], strict: bool = True,
                               custom_load_fn: Callable[..., Any] | None = None, fetch_z3_params: bool = False,
                               z3_params_to_fetch: Any = None, allowed_missing_keys: Any = None) -> None:
        """Load ``checkpoint["module"]`` into the module and the fp32 masters (collective: rank 0's
        values are kept, as DeepSpeed's ``GatheredParameters(modifier_rank=0)``)."""
        from zeroshard.zero import GatheredParameters

        if allowed_missing_keys is not None:
            raise NotYetSupportedError("load_module_state_dict(allowed_missing_keys=...) (AutoEP experts) is not "
                                       "supported", key="allowed_missing_keys")
        with GatheredParameters(list(self.module.parameters()), modifier_rank=0):
            if custom_load_fn is not None:
                custom_load_fn(src=checkpoint["module"], dst=self.module)
            else:
                self.module.load_state_dict(checkpoint["module"], strict=strict)

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name of ``save_16bit_model``."""
        return bool(self.save_16bit_model(save_dir, save_filename))  # type: ignore[attr-defined]

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> Any:
        """The full weights in the compute dtype on rank 0's CPU (``None`` on other ranks), ZeRO-3 only:
        what Hugging Face's Trainer and accelerate save (collective; :mod:`zeroshard.zero.state_dict`)."""
        from zeroshard.zero.state_dict import zero3_consolidated_16bit_state_dict

        return zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters)

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> Any:
        """DeepSpeed's dispatcher over ZeRO-3 and tensor parallelism (which zeroshard has not): ZeRO-3 only."""
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

    # -- data --------------------------------------------------------------------------------------------
    def deepspeed_io(self, dataset: Any, batch_size: int | None = None, route: str = "train",
                     pin_memory: bool = True, data_sampler: Any = None, collate_fn: Callable[..., Any] | None = None,
                     num_local_io_workers: int | None = None) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
        """A data loader over this rank's part of ``dataset`` (micro batch by default); training data is
        shuffled, ``route="eval"``/``"predict"`` is not."""
        if not (self.is_map_style_dataset(dataset) or self.is_iterable_style_dataset(dataset)):
            raise ValueError("Training data must be a torch Dataset")
        if self.is_iterable_style_dataset(dataset) and self.world_size > 1:
            # No indices to shard: every rank would read the whole stream (DeepSpeed fails here too).
            raise ValueError(f"deepspeed_io: a {type(dataset).__name__} is an IterableDataset, which cannot be "
                             f"sharded among the {self.world_size} ranks; shard it yourself (by rank) and build the "
                             "DataLoader in your script")
        if data_sampler is None and not self.is_iterable_style_dataset(dataset):
            data_sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=self.world_size,
                                                               rank=C.rank(self.group), shuffle=route == "train")
        return torch.utils.data.DataLoader(
            dataset, batch_size=batch_size or int(self.config.train_micro_batch_size_per_gpu or 1),
            sampler=data_sampler, collate_fn=collate_fn if collate_fn is not None else self.collate_fn,
            num_workers=num_local_io_workers or 0, pin_memory=pin_memory and torch.cuda.is_available(),
            drop_last=bool(self.config.dataloader_drop_last))

    collate_fn: Callable[..., Any] | None
    is_map_style_dataset: Callable[[Any], bool]
    is_iterable_style_dataset: Callable[[Any], bool]

    # -- compilation -------------------------------------------------------------------------------------
    def compile(self, backend: str = "inductor", compile_kwargs: dict[str, Any] | None = None,
                schedule: Any = None, compiled_autograd_enabled: bool = False) -> None:
        """``torch.compile`` the module in place (``nn.Module.compile``), as DeepSpeed's ``engine.compile``
        does without DeepCompile; accelerate calls it for ``dynamo_backend`` and the HF Trainer for
        ``torch_compile=True``. The ZeRO hooks run eagerly between the compiled regions, as when the
        model is compiled before ``initialize``. A second call is a no-op, as in DeepSpeed.

        Raises:
            NotYetSupportedError: for a DeepCompile ``schedule`` or ``compiled_autograd_enabled``.
        """
        if schedule is not None:
            raise NotYetSupportedError("engine.compile(schedule=...): DeepCompile schedules are not supported; "
                                       "call engine.compile() without one (plain torch.compile)", key="compile")
        if compiled_autograd_enabled:
            raise NotYetSupportedError("engine.compile(compiled_autograd_enabled=True): compiled autograd is not "
                                       "supported (ZeRO's gradient hooks run eagerly)", key="compile")
        if self.is_compiled:
            return
        kwargs = dict(compile_kwargs or {})
        if "backend" in kwargs:
            logger.warning("engine.compile: the `backend` in `compile_kwargs` is overridden by the `backend` argument")
        logger.info("zeroshard: compiling the module with torch.compile (backend=%s)", backend)
        self.module.compile(**{**kwargs, "backend": backend})
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        """Whether :meth:`compile` compiled the module (a model compiled before ``initialize`` is the
        user's, as in DeepSpeed: False)."""
        return bool(getattr(self, "_is_compiled", False))

    # -- resources ---------------------------------------------------------------------------------------
    def get_wall_clock_timers(self) -> dict[str, float]:
        """Seconds per timer since the last report (``wall_clock_breakdown``; empty when off)."""
        return dict(getattr(self.timers, "totals", {}))

    def collect_python_gc(self) -> int:
        """Run Python's garbage collector; the number of unreachable objects found."""
        return gc.collect()

    def empty_partition_cache(self) -> None:
        """ZeRO-3: release every gathered, non-persistent unit (other stages: nothing to release)."""
        coordinator = self.optimizer.coordinator
        if coordinator is not None:
            coordinator.end_of_pass(keep_frozen=False)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def destroy(self) -> None:
        """Detach the engine from the module (gradient hooks, ZeRO-3 hooks), stop the communication
        logger, close the monitors and remove the offload swap files. The engine cannot train
        afterwards."""
        self.optimizer.detach()  # gradient and ZeRO-3 hooks, swap files of NVMe offload
        comms = getattr(self, "comms_logger", None)
        if comms is not None:
            comms.uninstall()
        monitor = getattr(self, "monitor", None)
        if monitor is not None:
            monitor.close()
