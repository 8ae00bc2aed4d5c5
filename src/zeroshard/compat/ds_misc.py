"""Small DeepSpeed names that zeroshard's core has no place for, served by the compatibility layer.

``deepspeed.checkpoint.utils.clone_tensors_for_torch_save`` (accelerate calls it before saving a
ZeRO-3 state dict), ``deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME`` (the file whose
``KEY=VALUE`` lines ``zeroshard launch`` forwards to every host, as DeepSpeed's launcher does) and
``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`` (accelerate compares scheduler class names with it).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from zeroshard.optim import SUPPORTED_SCHEDULERS

#: DeepSpeed reads ``$DS_ENV_FILE`` once, at import; so does this module.
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")

#: The scheduler class names DeepSpeed builds from a config, in DeepSpeed's order.
VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
assert sorted(VALID_LR_SCHEDULES) == sorted(SUPPORTED_SCHEDULERS), "zeroshard's schedulers changed"


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """A copy of ``item`` with every tensor in it (nested lists, tuples, dicts) detached and on ``device``.

    A tensor already on ``device`` is cloned, so the copy never shares storage with a live parameter
    (saving a view would write the whole flat buffer behind it); other objects are returned as they are.
    """
    device = torch.device(device)
    if isinstance(item, torch.Tensor):
        return item.detach().clone() if item.device == device else item.detach().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
