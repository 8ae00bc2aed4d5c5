"""Precision policy and fp16 loss scaling."""

from zeroshard.core.precision.loss_scaler import DynamicLossScaler, LossScaler
from zeroshard.core.precision.policy import PrecisionPolicy, make_loss_scaler

__all__ = ["DynamicLossScaler", "LossScaler", "PrecisionPolicy", "make_loss_scaler"]
