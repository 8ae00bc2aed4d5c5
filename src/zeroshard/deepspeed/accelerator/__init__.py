"""``zeroshard.deepspeed.accelerator``: DeepSpeed's ``deepspeed.accelerator.get_accelerator()``.

Scripts written for DeepSpeed ask it for the device (``get_accelerator().device_name(local_rank)``),
synchronise, seed and read memory counters. zeroshard answers for CUDA when torch sees a GPU and for
the CPU otherwise (:mod:`.accelerators`); DeepSpeed methods it does not offer (graphs, op builders,
Triton) raise :class:`~zeroshard.errors.NotYetSupportedError` naming the method.
:func:`is_current_accelerator_supported` answers DeepSpeed's question of the same name.
"""

from __future__ import annotations

from zeroshard.deepspeed.accelerator.accelerators import Accelerator, CpuAccelerator, CudaAccelerator, get_accelerator

__all__ = ["Accelerator", "CpuAccelerator", "CudaAccelerator", "get_accelerator", "is_current_accelerator_supported"]

#: The accelerators zeroshard runs on (DeepSpeed's ``SUPPORTED_ACCELERATOR_LIST`` holds these and others).
SUPPORTED_ACCELERATORS = ("cuda", "cpu")


def is_current_accelerator_supported() -> bool:
    """DeepSpeed's ``deepspeed.accelerator.is_current_accelerator_supported``: whether the accelerator of
    this process is one zeroshard supports (CUDA or the CPU, the only two :func:`get_accelerator` gives)."""
    return get_accelerator().device_name() in SUPPORTED_ACCELERATORS
