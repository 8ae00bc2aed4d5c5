"""``GatheredParameters``: full parameters for the duration of a block, with optional write-back.

Under ZeRO-3 the parameters' units are gathered and pinned on entry and released on exit. With
``modifier_rank=r``, rank ``r``'s values at exit are broadcast to every rank and written into the
fp32 master and parameter shards, so the change survives the next step. Under stages 0–2 the
parameters are whole already; ``modifier_rank`` still broadcasts and updates the masters (which
otherwise would overwrite the change at the next step). Parameters built under ``zero.Init``
and not yet given to ``initialize`` are gathered from their chunks and, with ``modifier_rank``,
written back into them (how transformers loads pretrained weights into a ZeRO-3 model).
Parameters zeroshard does not manage are left alone, as in DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import torch

from zeroshard.core.comm import collectives as C
from zeroshard.core.partition import INIT_CHUNK_ATTR
from zeroshard.core.seam import Stage, owner_of
from zeroshard.zero.init import InitPartitioned


class GatheredParameters:
    """Context manager making ``params`` whole for the block (DeepSpeed's signature).

    Args:
        params: a parameter or an iterable of parameters; ``None`` entries are skipped.
        modifier_rank: rank whose modifications are kept and broadcast on exit; ``None`` discards
            modifications (they are made to temporary gathered copies under ZeRO-3).
        fwd_module: accepted for DeepSpeed compatibility (external-parameter registration is not
            needed here: units stay gathered while they are read).
        enabled: ``False`` makes the block a no-op.
    """

    def __init__(self, params: torch.nn.Parameter | Iterable[torch.nn.Parameter | None] | None,
                 modifier_rank: int | None = None, fwd_module: torch.nn.Module | None = None,
                 enabled: bool = True) -> None:
        given = [params] if params is None or isinstance(params, torch.nn.Parameter) else list(params)
        # None entries: transformers passes ``[old.weight, old.bias, new.weight, new.bias]`` with no biases
        self.params: list[torch.nn.Parameter] = [p for p in given if p is not None]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._exits: list[Callable[[], None]] = []
        self._pre_initialize = InitPartitioned()

    def _owned(self) -> dict[Any, list[torch.nn.Parameter]]:
        owners: dict[Any, list[torch.nn.Parameter]] = {}
        for p in self.params:
            owner: Stage | InitPartitioned | None = owner_of(p)
            if owner is None and getattr(p, INIT_CHUNK_ATTR, None) is not None:
                owner = self._pre_initialize  # built under zero.Init, not yet given to initialize
            if owner is not None:
                owners.setdefault(owner, []).append(p)
        return owners

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        for owner, params in self._owned().items():
            enter, exit_ = owner.gather_context(params)
            enter()
            self._exits.append(exit_)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self.enabled:
            return
        try:
            if self.modifier_rank is not None and exc_type is None:
                self._broadcast_and_write_back()
        finally:
            for exit_ in self._exits:
                exit_()
            self._exits.clear()

    def _broadcast_and_write_back(self) -> None:
        owners = self._owned()
        with torch.no_grad():
            for p in self.params:
                C.broadcast(p.data, self.modifier_rank, None)  # type: ignore[arg-type]
            for owner, params in owners.items():
                for p in params:
                    owner.write_back(p)
