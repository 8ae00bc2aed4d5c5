"""Mixed-precision blocks of the config: ``fp16``, ``bf16`` and ``data_types``.

Defaults follow DeepSpeed 0.19.x (``deepspeed/runtime/precision_config.py`` and
``deepspeed/runtime/constants.py``) except ``auto_cast``, which defaults to True here.
"""

from __future__ import annotations

from pydantic import Field

from zeroshard.config.fields import ConfigModel, DTypeName, Float, Int

__all__ = ["BF16Config", "DataTypesConfig", "FP16Config"]


class FP16Config(ConfigModel):
    """fp16 mixed precision with (by default dynamic) loss scaling."""

    enabled: bool = False
    """Train with fp16 compute weights and fp32 master weights."""

    auto_cast: bool = True
    """Cast floating-point inputs of the model's forward to fp16. zeroshard defaults to True (cast floating
    inputs by default); DeepSpeed defaults to False."""

    loss_scale: Float = Field(default=0.0, ge=0)
    """Static loss scale; 0 selects dynamic loss scaling."""

    initial_scale_power: Int = Field(default=16, ge=0)
    """Dynamic loss scaling starts at 2**initial_scale_power."""

    loss_scale_window: Int = Field(default=1000, gt=0)
    """Number of overflow-free steps after which the dynamic loss scale is doubled."""

    hysteresis: Int = Field(default=2, ge=1)
    """Number of overflows tolerated before the dynamic loss scale is lowered (delayed shift)."""

    consecutive_hysteresis: bool = False
    """Refill the hysteresis counter on every overflow-free step instead of only after a scale raise."""

    min_loss_scale: Int = Field(default=1, gt=0)
    """Lower bound of the dynamic loss scale."""


class BF16Config(ConfigModel):
    """bf16 mixed precision (no loss scaling needed). Also accepted under the legacy key ``bfloat16``."""

    enabled: bool = False
    """Train with bf16 compute weights and fp32 master weights."""

    auto_cast: bool = True
    """Cast floating-point inputs of the model's forward to bf16. zeroshard defaults to True (cast floating
    inputs by default); DeepSpeed has no such key for bf16."""

    check_grad_overflow: bool = True
    """Skip the optimizer step when the gradient norm is NaN or Inf (DeepSpeed's default, True;
    ``non_finite_gradients`` chooses skip or raise). ``false`` applies such a step, as DeepSpeed does:
    the parameters then hold NaN or Inf (``initialize`` warns; ``non_finite_gradients: raise`` beside it
    is an error)."""


class DataTypesConfig(ConfigModel):
    """Explicit data types for parts of the training step."""

    grad_accum_dtype: DTypeName | None = None
    """Dtype in which gradients are accumulated across micro-steps (fp32, fp16 or bf16). None selects fp32
    in zeroshard; DeepSpeed's None means "the model's dtype"."""
