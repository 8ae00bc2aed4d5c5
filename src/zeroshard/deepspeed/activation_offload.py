"""DeepSpeed's ``deepspeed.runtime.activation_checkpointing.offload_activations``, on zeroshard's
activation offload (:mod:`zeroshard.activations.offload`).

``CheckpointHiddenStatesOffload`` is :class:`~zeroshard.activations.offload.HiddenStatesOffload` with
its host buffers page-locked through ``get_accelerator().pin_memory`` (as DeepSpeed's, so a patched
or counted accelerator sees each pinning). Semantics, the CPU included (marked host tensors are
skipped: they are in host memory already), are in that module's documentation and in
``docs/activation-checkpointing.md``.
"""

from __future__ import annotations

import torch

from zeroshard.activations.offload import HiddenStatesOffload, OffloadStats
from zeroshard.deepspeed.accelerator import get_accelerator

__all__ = ["CheckpointActivationOffloadStats", "CheckpointHiddenStatesOffload",
           "get_checkpoint_hidden_states_offloading_ctx_manager"]

CheckpointActivationOffloadStats = OffloadStats
"""DeepSpeed's name of the counters."""


class CheckpointHiddenStatesOffload(HiddenStatesOffload):
    """Offload the marked checkpoint inputs (hidden states) to host memory; see :class:`HiddenStatesOffload`."""

    def _pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return get_accelerator().pin_memory(tensor)


def get_checkpoint_hidden_states_offloading_ctx_manager(
        use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
        max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64,
        keep_last_count: int = 1) -> CheckpointHiddenStatesOffload:
    """A new :class:`CheckpointHiddenStatesOffload` with these settings (DeepSpeed's factory)."""
    return CheckpointHiddenStatesOffload(use_pin_memory=use_pin_memory, use_streams=use_streams,
                                         min_offload_bytes=min_offload_bytes,
                                         max_fwd_stash_count=max_fwd_stash_count,
                                         max_cpu_buffer_pool_count=max_cpu_buffer_pool_count,
                                         keep_last_count=keep_last_count)
