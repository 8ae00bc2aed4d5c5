"""Activation checkpointing: keep only each checkpointed region's inputs, recompute the region in
backward (DeepSpeed's ``deepspeed.checkpointing``, public as :mod:`zeroshard.deepspeed.checkpointing`).

Not to be confused with :mod:`zeroshard.checkpoint`, which saves and loads training state.

- ``settings.py``: :func:`configure`, :func:`is_configured`, the config block, the process-wide settings;
- ``storage.py``: where the inputs wait (whole, partitioned over the model-parallel group, on the host);
- ``rng.py``: the named RNG states of model-parallel dropout (``get_cuda_rng_tracker``);
- ``function.py``: :func:`checkpoint` itself, on ``torch.utils.checkpoint`` (non-reentrant);
- ``offload.py``: :class:`HiddenStatesOffload`, saved-tensor hooks that move the marked inputs of
  checkpointed regions to host memory until backward (DeepSpeed's ``CheckpointHiddenStatesOffload``).
"""

from __future__ import annotations

from zeroshard.activations.function import checkpoint, non_reentrant_checkpoint
from zeroshard.activations.offload import HiddenStatesOffload, OffloadStats, current_offload
from zeroshard.activations.rng import (
    RNGStatesTracker,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from zeroshard.activations.settings import (
    Settings,
    configure,
    configure_from_initialize,
    current,
    is_configured,
    partition_activations_in_checkpoint,
    set_num_layers,
    unconfigure,
)
from zeroshard.activations.storage import STATS, SavedInputStats


def reset() -> None:
    """DeepSpeed's ``reset()`` frees its contiguous buffers after forwards without backward; inputs
    held here belong to the autograd graph and are freed with it, so there is nothing to do."""


__all__ = [
    "STATS",
    "HiddenStatesOffload",
    "OffloadStats",
    "RNGStatesTracker",
    "SavedInputStats",
    "Settings",
    "checkpoint",
    "configure",
    "configure_from_initialize",
    "current",
    "current_offload",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "set_num_layers",
    "unconfigure",
]
