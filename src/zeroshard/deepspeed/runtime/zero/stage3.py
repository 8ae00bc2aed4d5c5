"""DeepSpeed's ``deepspeed.runtime.zero.stage3`` names: the ZeRO-3 memory estimators and
:func:`unwrap_model_for_generation`.

``from zeroshard.deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live``
works as it does with DeepSpeed; the implementation is :mod:`zeroshard.estimate.formulas`. Importing
this module does not import torch (the estimators run on machines without it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from zeroshard.estimate.formulas import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from zeroshard.estimate.formulas import zero3_model_to_params as model_to_params

__all__ = [
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "model_to_params",
    "unwrap_model_for_generation",
]


@contextlib.contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """Gather every parameter of the engine ``model`` once, and run the block without ZeRO-3's module hooks.

    Generation runs many small forwards; gathering the whole model first and detaching the per-module
    hooks saves a gather and a release per module per token. Yields ``model`` (the engine). On exit the
    hooks are attached again (the next forward traces the module order afresh) and the parameters go
    back to their partitions, modifications discarded as with ``GatheredParameters`` (DeepSpeed's
    ``deepspeed.runtime.zero.unwrap_model_for_generation``, TRL's generation recipe). Collective:
    enter it on every rank. The block may differ between ranks (one rank generating longer): with
    the hooks off, forwards run no collectives.

    An engine at stages 0-2 has every parameter whole and no such hooks: the block just runs.
    """
    from zeroshard.zero.gathered import GatheredParameters  # here: importing the estimators needs no torch

    with GatheredParameters(list(model.parameters())):
        offload = getattr(getattr(model, "optimizer", None), "parameter_offload", None)
        if offload is None:  # stages 0-2, or an engine without an optimizer: nothing to detach
            yield model
            return
        for hook in [*offload.forward_hooks, *offload.backward_hooks]:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield model
        finally:
            offload._register_deepspeed_module(offload.module)
