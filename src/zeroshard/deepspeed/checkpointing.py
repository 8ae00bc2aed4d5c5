"""``zeroshard.deepspeed.checkpointing``: DeepSpeed's ``deepspeed.checkpointing`` activation-checkpointing API.

A thin public name over :mod:`zeroshard.activations` (the implementation), so that
``import zeroshard as deepspeed; deepspeed.checkpointing.checkpoint(block, x)`` runs unchanged.
Training-state checkpoints (``save_checkpoint``/``load_checkpoint``) are :mod:`zeroshard.checkpoint`.
"""

from __future__ import annotations

from zeroshard.activations import (
    RNGStatesTracker,
    checkpoint,
    configure,
    get_cuda_rng_tracker,
    is_configured,
    model_parallel_cuda_manual_seed,
    non_reentrant_checkpoint,
    partition_activations_in_checkpoint,
    reset,
    set_num_layers,
)

CudaRNGStatesTracker = RNGStatesTracker
"""DeepSpeed's class name (the tracker uses the CPU generator when there is no CUDA)."""

__all__ = [
    "CudaRNGStatesTracker",
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "set_num_layers",
]
