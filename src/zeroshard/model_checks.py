"""Module patterns the ZeRO stages cannot train as plain PyTorch does, found before anything moves.

- A lazy module (``torch.nn.LazyLinear``) not yet run has parameters without a shape, which no
  flat buffer can hold: torch's own error came from deep inside ``initialize`` and named no
  parameter.
- ``nn.Embedding(sparse=True)`` hands autograd a sparse gradient, which the flat gradient buffers
  cannot take: the backward crashed in a gradient hook (DeepSpeed fails there too).
- ``nn.Embedding(max_norm=...)`` renormalises the rows it reads *in place during forward*. Each
  rank sees only its own micro-batch, and from stage 1 on the weights the forward reads are not the
  ones the optimizer keeps: at stages 1–2 a rank keeps the renormalisation of its own shard's rows
  only, at stage 3 and in 16-bit training the renormalisation lands in a copy and is lost (measured
  on two ranks: 1.8e-2 and 4.6e-1 of the weights' norm from plain PyTorch, DeepSpeed 4.6e-1 at
  stages 1–3). Only fp32 training of one rank at stages 0–2 keeps it exactly. It trains, as it does
  under DeepSpeed, with a warning naming the module.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter

from zeroshard.errors import ConfigError, NotYetSupportedError

logger = logging.getLogger("zeroshard")

_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def check_model(model: nn.Module, stage: int, world: int, sixteen_bit: bool, warn: bool) -> None:
    """Refuse a model with unmaterialised (lazy) tensors or sparse-gradient embeddings, naming them;
    with ``warn`` (rank 0), warn about embeddings whose forward renormalises their weight where
    that is not what plain PyTorch does."""
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            if isinstance(t, (UninitializedParameter, UninitializedBuffer)):
                raise ConfigError(f"model {kind} {name!r} is not materialized yet (a lazy module such as "
                                  "torch.nn.LazyLinear): run one forward pass with a sample batch before "
                                  "initialize, so that its shape is known")
    for name, module in model.named_modules():
        if not isinstance(module, _EMBEDDINGS):
            continue
        if module.sparse:
            raise NotYetSupportedError(f"module {name!r} ({type(module).__name__}) has sparse=True: sparse "
                                       "gradients are not supported; build it with sparse=False (its gradient "
                                       "is then sharded like any other)")
        if warn and module.max_norm is not None and (stage == 3 or world > 1 or sixteen_bit):
            logger.warning("zeroshard: module %r (%s) has max_norm=%g, so its forward renormalises the weight's "
                           "rows in place; %s. Set max_norm=None, or renormalise the weight yourself outside "
                           "forward", name, type(module).__name__, module.max_norm,
                           _max_norm_effect(stage, sixteen_bit))


def _max_norm_effect(stage: int, sixteen_bit: bool) -> str:
    if sixteen_bit:
        return ("in 16-bit training that happens in the 16-bit copy, not in the fp32 master weights the "
                "optimizer steps, so the trained weight is never renormalised")
    if stage == 3:
        return ("at ZeRO-3 that happens in the gathered copy and is not kept, so the trained weight is never "
                "renormalised (as in DeepSpeed)")
    if stage > 0:
        return (f"at ZeRO-{stage} each rank keeps that of the rows in its own shard only, from its own "
                "micro-batch, so the weight differs from single-process training")
    return "each rank renormalises the rows its own micro-batch reads, so the ranks' weights drift apart (as under DDP)"
