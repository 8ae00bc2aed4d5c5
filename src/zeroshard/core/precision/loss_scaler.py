"""Loss scaling for fp16 training (DeepSpeed's semantics).

The scaler only decides numbers; the optimizer detects overflow (a non-finite global gradient
norm, which is already agreed across ranks because the norm is all-reduced or the gradients were)
and reports it here with :meth:`LossScaler.update`.

Dynamic scaling follows DeepSpeed's ``DynamicLossScaler``: on overflow the step is skipped and,
once ``hysteresis`` overflows have been absorbed, the scale is divided by 2 (never below
``min_loss_scale``); after ``loss_scale_window`` clean steps since the last overflow it doubles.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("zeroshard")


class LossScaler:
    """A constant scale (1.0 for fp32/bf16, or fp16's static ``loss_scale``)."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = float(scale)

    def _get_scale(self) -> float:
        return self.scale

    def _set_scale(self, value: float) -> None:
        self.scale = float(value)

    #: DeepSpeed's names for the scale (scripts log ``engine.optimizer.loss_scaler.cur_scale``)
    cur_scale = property(_get_scale, _set_scale)
    loss_scale = property(_get_scale, _set_scale)

    def update(self, overflow: bool) -> None:
        """Record the outcome of a step; a static scaler only logs overflows."""
        if overflow:
            logger.warning("fp16 overflow with static loss scale %g: step skipped", self.scale)

    def state_dict(self) -> dict[str, Any]:
        """Serializable state (plain numbers)."""
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.scale = float(state["scale"])


class DynamicLossScaler(LossScaler):
    """DeepSpeed-compatible dynamic loss scaler with hysteresis."""

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        scale_factor: float = 2.0,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        super().__init__(init_scale)
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.scale_factor = scale_factor
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.cur_hysteresis = hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def update(self, overflow: bool) -> None:
        """Lower the scale after overflows (with hysteresis), raise it after a clean window."""
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.scale == self.min_scale and self.raise_error_at_min_scale:
                    # As DeepSpeed: skipping every step at the floor would train nothing, silently.
                    raise FloatingPointError(
                        f"fp16 gradients overflow at the minimum loss scale {self.min_scale:g}: training "
                        "has diverged (lower the learning rate, use bf16, or lower fp16.min_loss_scale)"
                    )
                new_scale = max(self.scale / self.scale_factor, self.min_scale)
                logger.warning(
                    "fp16 gradient overflow: step skipped, loss scale %g -> %g", self.scale, new_scale
                )
                self.scale = new_scale
            else:
                logger.warning(
                    "fp16 gradient overflow: step skipped, loss scale %g kept (hysteresis %d left)",
                    self.scale,
                    self.cur_hysteresis - 1,
                )
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            stable = self.cur_iter - self.last_overflow_iter - 1  # clean steps since the overflow
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        """Serializable state (plain numbers)."""
        return {
            "scale": self.scale,
            "cur_hysteresis": self.cur_hysteresis,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.scale = float(state["scale"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
