"""The whole model's state dict on rank 0, gathered module by module: DeepSpeed's
``engine._zero3_consolidated_16bit_state_dict()``.

Hugging Face's Trainer and accelerate save a ZeRO-3 model by asking the engine for this dict and
writing it with ``save_pretrained``. Every rank walks the modules in the same order and gathers
each module's own parameters for a moment (a collective, under ZeRO-3); rank 0 copies them to the
CPU in the compute dtype, so it ends up holding the whole model once (what the callers write), never
two modules' gathered parameters at once. Tied parameters map to one tensor under every name (the
callers drop the duplicates), persistent buffers are included, as in DeepSpeed.
:func:`zeroshard.zero.export.save_16bit_model` writes the same weights without holding them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.zero.gathered import GatheredParameters


def consolidated_state_dict(module: torch.nn.Module,
                            exclude_frozen_parameters: bool = False) -> OrderedDict[str, torch.Tensor] | None:
    """``module``'s full parameters and persistent buffers on the CPU on rank 0; ``None`` on other ranks.

    Collective: call on every rank of the module's group.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    out: OrderedDict[str, torch.Tensor] | None = OrderedDict() if rank == 0 else None
    first_name: dict[int, str] = {}  # id(parameter) -> the key it was stored under (tied weights)
    for prefix, sub in module.named_modules():
        own = [p for p in sub.parameters(recurse=False) if p is not None]
        dot = f"{prefix}." if prefix else ""
        with GatheredParameters(own, enabled=bool(own)):
            if out is None:
                continue
            for name, p in sub.named_parameters(recurse=False):
                if exclude_frozen_parameters and not p.requires_grad:
                    continue
                if id(p) in first_name:
                    out[dot + name] = out[first_name[id(p)]]
                else:
                    out[dot + name] = p.detach().cpu().clone()
                    first_name[id(p)] = dot + name
            for name, buf in sub.named_buffers(recurse=False):
                if buf is not None and name not in sub._non_persistent_buffers_set:
                    out[dot + name] = buf.detach().cpu().clone()
    return out


def zero3_consolidated_16bit_state_dict(engine: Any, exclude_frozen_parameters: bool = False) -> Any:
    """DeepSpeed's ``engine._zero3_consolidated_16bit_state_dict``: ZeRO-3 only (a ``ValueError`` otherwise,
    which Hugging Face's Trainer catches to save a full checkpoint instead)."""
    if engine.zero_optimization_stage() != 3:
        raise ValueError("this function requires ZeRO-3 mode")
    out = consolidated_state_dict(engine.module, exclude_frozen_parameters)
    engine.optimizer.coordinator.after_consolidated_state_dict(dist.get_rank() if dist.is_initialized() else 0)
    return out
