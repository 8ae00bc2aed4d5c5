"""Small DeepSpeed names that zeroshard's core has no place for, served by the compatibility layer.

``deepspeed.checkpoint.utils.clone_tensors_for_torch_save`` (accelerate calls it before saving a
ZeRO-3 state dict), ``deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME`` (the file whose
``KEY=VALUE`` lines ``zeroshard launch`` forwards to every host, as DeepSpeed's launcher does),
``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`` (accelerate compares scheduler class names with it),
``deepspeed.compression.helper.recursive_getattr``/``recursive_setattr`` (DeepSpeed-Chat's LoRA code
replaces submodules by dotted name with them), ``deepspeed.runtime.utils.see_memory_usage`` and
``set_random_seed``, ``deepspeed.utils.torch.required_torch_version`` (version gates in scripts and
DeepSpeed's tests), ``deepspeed.runtime.zero.offload_config.OffloadDeviceEnum`` (the offload devices, for
configs built in code), ``deepspeed.runtime.zero.leaf_module_config``'s defaults,
``deepspeed.checkpoint.utils.get_model_ckpt_name_for_rank`` (the model file of a DeepSpeed checkpoint,
as ``zeroshard convert --to deepspeed`` writes it) and ``deepspeed.runtime.swap_tensor.MIN_SWAPPABLE_BYTES``.
"""

from __future__ import annotations

import gc
import os
import random
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from zeroshard.config.zero import DEFAULT_LEAF_MODULE_CLASSES as _LEAF_CLASSES
from zeroshard.deepspeed.accelerator import CpuAccelerator, get_accelerator
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


def recursive_getattr(model: Any, module_name: str) -> Any:
    """The attribute at dotted path ``module_name`` under ``model`` (``"encoder.layer.0.query"``)."""
    output = model
    for name in module_name.split("."):
        output = getattr(output, name)
    return output


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Set the attribute at dotted path ``module_name`` under ``model`` to ``module``.

    Through the owner's ``__setattr__``, so a module assigned under an ``nn.Module`` is registered
    as its child (it replaces the one of that name).
    """
    *path, last = module_name.split(".")
    setattr(recursive_getattr(model, ".".join(path)) if path else model, last, module)


_GIB = 1024**3


def _host_memory_gib() -> tuple[float, float]:
    """(used GiB, percent used) of the machine's memory: total less available, as ``psutil`` counts it
    (the host's figures whatever the accelerator)."""
    host = CpuAccelerator()
    total, available = host.total_memory(), host.available_memory()
    used = total - available
    return used / _GIB, 100.0 * used / total if total else 0.0


def see_memory_usage(message: str, force: bool = False) -> None:
    """DeepSpeed's ``deepspeed.runtime.utils.see_memory_usage``: print ``message`` and memory counters.

    As DeepSpeed: nothing unless ``force`` is true, and only on rank 0 when a process group exists.
    Prints the accelerator's allocated and reserved memory (current and peak, GiB; the process's
    resident memory on the CPU) and the machine's memory in use, then resets the peak counters.
    """
    if not force:
        return
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    gc.collect()  # collect garbage first, so that freed objects are not counted (DeepSpeed does too)
    acc = get_accelerator()
    print(message)
    print(f"MA {acc.memory_allocated() / _GIB:.2f} GB    Max_MA {acc.max_memory_allocated() / _GIB:.2f} GB    "
          f"CA {acc.memory_reserved() / _GIB:.2f} GB    Max_CA {acc.max_memory_reserved() / _GIB:.2f} GB")
    used, percent = _host_memory_gib()
    print(f"CPU Virtual Memory:  used = {used:.2f} GB, percent = {percent:.1f}%")
    acc.reset_peak_memory_stats()


def set_random_seed(seed: int) -> None:
    """DeepSpeed's ``deepspeed.runtime.utils.set_random_seed``: seed Python's, NumPy's (when installed)
    and torch's generators."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed)
    torch.manual_seed(seed)


def required_torch_version(min_version: float | str | None = None, max_version: float | str | None = None) -> bool:
    """Whether the installed torch is at least ``min_version`` and at most ``max_version`` (PEP 440
    order: ``2.13.0+cpu`` is above ``2.13``). Versions may be numbers, as DeepSpeed's callers pass them
    (``min_version=1.8``; a number is read as it prints, so ``2.10`` is ``"2.1"``).

    Raises:
        AssertionError: neither bound given (DeepSpeed's error for it).
    """
    if not min_version and not max_version:
        raise AssertionError("Must provide a min_version or max_version argument")
    installed = TorchVersion(torch.__version__)
    if min_version and installed < str(min_version):
        return False
    return not (max_version and installed > str(max_version))


class OffloadDeviceEnum(str, Enum):
    """DeepSpeed's offload devices (``offload_param.device``, ``offload_optimizer.device``); members are
    the strings themselves, so they can stand in a config dict."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


#: DeepSpeed's default ``zero_optimization.leaf_module`` lists (zeroshard's config has the same defaults).
DEFAULT_LEAF_MODULE_CLASSES: list[str] = list(_LEAF_CLASSES)
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []

#: DeepSpeed swaps tensors of at least this many bytes to NVMe (1 MiB) and keeps smaller ones in memory.
#: zeroshard's NVMe offload swaps whole buckets whatever the tensor sizes; the value is DeepSpeed's, for
#: scripts that size a model by it.
MIN_SWAPPABLE_BYTES = 1024**2


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """The model-states file of model-parallel rank ``mp_rank_str`` (``"00"``) in the DeepSpeed checkpoint
    directory ``base_folder``: ``base_folder/mp_rank_00_model_states.pt``. zeroshard writes these files
    when converting to DeepSpeed's format; its own checkpoints have none."""
    return os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")


#: DeepSpeed's shape of a partitioned parameter's ``data`` (an empty placeholder); zeroshard's is the same
partitioned_param_data_shape = [0]
