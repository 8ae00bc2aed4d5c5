"""Refuse client optimizers whose update of a parameter depends on its shape or on whole-tensor statistics.

zeroshard's optimizer steps fp32 master *views*: flat 1-D slices of each rank's shard, at every stage
(stage 0 included, where the slice is the whole parameter, flattened). An elementwise optimizer (Adam,
AdamW, SGD, Lion, Adagrad...) computes the same update on such a view as on the parameter. One that
reads the parameter's shape (Adafactor's factored second moment, Muon's orthogonalised 2-D update,
GaLore's low-rank projection, Shampoo's preconditioners) or reduces over a whole tensor or over every
tensor (LAMB's and LARS's per-tensor trust ratio, Prodigy's and D-Adaptation's global sums) computes a
different update, so the run would silently train differently from plain PyTorch: measured with
``torch.optim.Adafactor`` on a two-layer MLP, 0.97% of the weights' norm apart after 5 steps in a
world of one. DeepSpeed flattens the same way (a factored optimizer silently becomes unfactored);
zeroshard says so instead.

The check knows these optimizers by the names of the classes in their MRO (families by a part of
the name: ``lamb`` catches bitsandbytes' ``LAMB8bit`` and apex's ``FusedLamb``), so subclasses and
the same optimizers from transformers, timm, apex, torch-optimizer or bitsandbytes are caught too.
An optimizer it does not know is the caller's to vouch for (docs/deepspeed-differences.md says what "elementwise"
means here).
"""

from __future__ import annotations

import functools
from typing import Any

from zeroshard.errors import NotYetSupportedError

#: lower-cased class names: families matched anywhere in a name (``LAMB8bit``, ``FusedNovoGrad``,
#: ``MuonWithAuxAdam``, ``AdafactorBigVision``, ``GaLoreAdamW``, ``DAdaptAdam``...), and names too
#: short or too common to match inside others, matched whole
_FAMILIES = ("adafactor", "muon", "lamb", "lars", "novograd", "shampoo", "galore", "dadapt", "prodigy", "apollo",
             "adahessian", "ranger")
_EXACT = frozenset({"soap", "came", "sm3", "kron", "adamp", "sgdp", "adam_mini", "adammini", "lbfgs", "sparseadam"})


def _shape_dependent(cls: type) -> type | None:
    """The first class of ``cls``'s MRO known to be shape-dependent (a subclass of one is too)."""
    for c in cls.__mro__:
        name = c.__name__.lower()
        if name in _EXACT or any(f in name for f in _FAMILIES):
            return c
    return None


def _class_of(optimizer: Any) -> type | None:
    """The optimizer class an ``initialize(optimizer=...)`` argument builds, when it can be told."""
    if isinstance(optimizer, functools.partial):
        optimizer = optimizer.func
    if isinstance(optimizer, type):
        return optimizer
    if callable(optimizer) and not hasattr(optimizer, "param_groups"):
        return None  # a factory function: checked on what it returns
    return type(optimizer)


def refuse_shape_dependent(optimizer: Any) -> None:
    """Raise if ``optimizer`` (an instance, an optimizer class, or a ``functools.partial`` of one) is
    known to update a parameter from its shape or from whole-tensor statistics.

    Raises:
        NotYetSupportedError: with key ``optimizer``, naming the class and why.
    """
    cls = _class_of(optimizer)
    if cls is None:
        return
    known = _shape_dependent(cls)
    if known is None:
        return
    what = f"{cls.__module__}.{cls.__qualname__}"
    if known is not cls:
        what += f" (a {known.__qualname__})"
    raise NotYetSupportedError(
        f"the optimizer {what} is not supported yet: its update of a parameter depends on the parameter's "
        "shape or on statistics over whole tensors (or, SparseAdam, on sparse gradients), and zeroshard's "
        "optimizer steps flat 1-D views of each rank's shard, so it would train differently from plain "
        "PyTorch. Use an elementwise optimizer (AdamW, Adam, SGD, Lion, Adagrad, RMSprop...)",
        key="optimizer",
    )
