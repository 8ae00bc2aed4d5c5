"""``zeroshard.accelerator``: DeepSpeed's ``deepspeed.accelerator.get_accelerator()``.

Scripts written for DeepSpeed ask it for the device (``get_accelerator().device_name(local_rank)``),
synchronise, seed and read memory counters. zeroshard answers for CUDA when torch sees a GPU and for
the CPU otherwise (:mod:`.accelerators`); DeepSpeed methods it does not offer (graphs, op builders,
Triton) raise :class:`~zeroshard.errors.NotYetSupportedError` naming the method.
"""

from __future__ import annotations

from zeroshard.accelerator.accelerators import Accelerator, CpuAccelerator, CudaAccelerator, get_accelerator

__all__ = ["Accelerator", "CpuAccelerator", "CudaAccelerator", "get_accelerator"]
