"""Optimizers and LR schedules built from DeepSpeed's ``"optimizer"`` and ``"scheduler"`` config sections.

:func:`build_optimizer` turns ``optimizer.type``/``optimizer.params`` into a torch optimizer with
DeepSpeed's semantics (``"Adam"`` means AdamW unless ``"adam_w_mode": false``) and torch's fastest
implementation for the parameters' device. :func:`build_scheduler` builds DeepSpeed's per-batch LR
schedules, re-implemented to give bit-identical LR (and momentum) sequences.
"""

from zeroshard.optim.cyclic import LRRangeTest, OneCycle
from zeroshard.optim.factory import SUPPORTED_OPTIMIZERS, build_optimizer, implementation_flags
from zeroshard.optim.lion import Lion
from zeroshard.optim.schedulers import SUPPORTED_SCHEDULERS, BatchSchedule, build_scheduler
from zeroshard.optim.warmup import WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = [
    "SUPPORTED_OPTIMIZERS",
    "SUPPORTED_SCHEDULERS",
    "BatchSchedule",
    "LRRangeTest",
    "Lion",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_optimizer",
    "build_scheduler",
    "implementation_flags",
]
