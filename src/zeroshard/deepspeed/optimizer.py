"""DeepSpeed's ZeRO optimizer attributes on the optimizer ``initialize`` returns.

Scripts and frameworks read ``engine.optimizer.cur_scale`` (or ``loss_scale``), ``loss_scaler``,
``dynamic_loss_scale``, call ``state_dict()`` while saving (Lightning) and ``_get_norm_groups()`` /
``_global_grad_norm`` (DeepSpeed's own tests). :class:`DeepSpeedOptimizerViews` adds them to
zeroshard's stages; :data:`DEEPSPEED_STAGES` are the classes ``initialize`` hands the stage builder.
"""

from __future__ import annotations

from typing import Any

import torch

from zeroshard.core.precision import LossScaler
from zeroshard.core.zero3.stage3 import Stage3Optimizer
from zeroshard.core.zero_optimizer import ZeroOptimizer
from zeroshard.deepspeed.offload_states import OptimizerStateOffload
from zeroshard.errors import NotYetSupportedError

__all__ = ["DEEPSPEED_STAGES", "DeepSpeedOptimizerViews", "DeepSpeedStage3Optimizer", "DeepSpeedZeroOptimizer"]


def _use_checkpoints(method: str, instead: str) -> NotYetSupportedError:
    return NotYetSupportedError(
        f"engine.optimizer.{method}() is not supported: the optimizer state is sharded across ranks (and may live "
        f"in host memory or swap files); {instead}", key=f"optimizer.{method}")


class DeepSpeedOptimizerViews(OptimizerStateOffload):
    """DeepSpeed's names for a stage's loss scaling, norms and per-rank state (views, no state of their
    own), and its ``offload_states()`` / ``reload_states()`` (:class:`OptimizerStateOffload`)."""

    def _get_loss_scale(self) -> float:
        return float(self.scaler.scale)

    def _set_loss_scale(self, value: float) -> None:
        self.scaler.scale = float(value)

    #: the loss scale in use now (1.0 unless fp16), under both names DeepSpeed's ZeRO optimizers
    #: give it (scripts log ``engine.optimizer.cur_scale``)
    cur_scale = property(_get_loss_scale, _set_loss_scale)
    loss_scale = property(_get_loss_scale, _set_loss_scale)
    #: DeepSpeed's ZeRO optimizers' loss-scaling attributes: no client scaler, no external scale
    custom_loss_scaler = False
    external_loss_scale = None

    @property
    def loss_scaler(self) -> LossScaler:
        """The loss scaler (DeepSpeed's attributes: ``cur_scale``, and for dynamic scaling
        ``cur_hysteresis``, ``cur_iter``, ``last_overflow_iter``, ``scale_window``, ``min_scale``)."""
        return self.scaler

    @property
    def dynamic_loss_scale(self) -> bool:
        """Whether the loss scale adapts to overflows (fp16 with ``loss_scale: 0``)."""
        return bool(self.scaler.dynamic)

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the optimizer, as DeepSpeed's ZeRO optimizers return theirs (frameworks
        call it while saving: Lightning's ``Trainer.save_checkpoint`` builds it, then saves through
        ``engine.save_checkpoint``): ``zero_stage``, ``partition_count`` (ranks sharing the state), ``rank``,
        ``base_optimizer_state`` (the torch optimizer's state dict over this rank's flat fp32 master
        views, entries read from swap files when offloaded to NVMe), ``fp32_master_shard`` (those
        views' values, in the same order) and ``loss_scaler``.

        In memory the tensors are the live ones, not copies (as DeepSpeed's). It is a view of one rank
        at one world size and stage, so :meth:`load_state_dict` does not take it back;
        ``engine.save_checkpoint`` is the form that reloads (at any world size and stage).
        """
        inner = self.optimizer
        if inner is None:
            raise RuntimeError("state_dict() before an optimizer was bound")
        masters = [m for g in inner.param_groups for m in g["params"]]
        index = {id(m): i for i, m in enumerate(masters)}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(m)] for m in g["params"]]}
                  for g in inner.param_groups]
        state = {i: self.store.state(m) for i, m in enumerate(masters) if self.store.has_state(m)}
        return {"zero_stage": self.spec.stage, "partition_count": self.plan.layout_world, "rank": self.rank,
                "base_optimizer_state": {"state": state, "param_groups": groups},
                "fp32_master_shard": [self.store.master_values(m) for m in masters],
                "loss_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Not supported: :meth:`state_dict` is one rank's view at one world size and stage.

        Raises:
            NotYetSupportedError: always, naming ``engine.load_checkpoint`` instead.
        """
        raise _use_checkpoints("load_state_dict", "load it with engine.load_checkpoint(dir), from a checkpoint "
                               "saved by engine.save_checkpoint (zeroshard's or DeepSpeed's)")

    def _get_norm_groups(self) -> list[torch.Tensor]:
        """DeepSpeed's: the norm of the gradients accumulated so far, loss scale divided out, as a list
        of one (zeroshard clips by one global norm). Collective when sharded."""
        return [torch.tensor(self.current_grad_norm())]

    @property
    def _global_grad_norm(self) -> float | None:
        """DeepSpeed's name for :attr:`global_grad_norm`."""
        return self.global_grad_norm


class DeepSpeedZeroOptimizer(DeepSpeedOptimizerViews):
    """Stages 0-2 with DeepSpeed's optimizer attributes."""


class DeepSpeedStage3Optimizer(DeepSpeedOptimizerViews, Stage3Optimizer):
    """Stage 3 with DeepSpeed's optimizer attributes."""


#: the stage classes ``initialize`` builds: (stages 0-2, stage 3)
DEEPSPEED_STAGES: tuple[type[ZeroOptimizer], type[Stage3Optimizer]] = (DeepSpeedZeroOptimizer,
                                                                      DeepSpeedStage3Optimizer)
