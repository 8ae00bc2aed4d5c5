"""DeepSpeed's ``ds_*`` attributes on ZeRO-3 parameters, kept current by observing the core's units.

Scripts and libraries written for DeepSpeed tell a partitioned parameter by ``hasattr(p, "ds_id")``,
gather it when ``p.ds_status == ZeroParamStatus.NOT_AVAILABLE``, read ``p.ds_shape``,
``p.ds_numel``, ``p.ds_persist`` and this rank's padded partition ``p.ds_tensor``. The core knows
none of these names: ``initialize`` hands :data:`DEEPSPEED_PARAM_ATTRS` to the stage builder, which
passes it to every unit (:class:`zeroshard.core.seam.ParamObserver`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from zeroshard.core.zero3.param_unit import UnitState
from zeroshard.zero.init import tag_deepspeed
from zeroshard.zero.param_status import ZeroParamStatus

__all__ = ["DEEPSPEED_PARAM_ATTRS", "DeepSpeedParamAttrs"]

_STATUS = {UnitState.SHARDED: ZeroParamStatus.NOT_AVAILABLE, UnitState.GATHERING: ZeroParamStatus.INFLIGHT,
           UnitState.GATHERED: ZeroParamStatus.AVAILABLE}


class DeepSpeedParamAttrs:
    """Writes DeepSpeed's attributes on each parameter a unit adopts, and ``ds_status`` on each
    state change."""

    def partitioned(self, p: torch.nn.Parameter, shape: torch.Size, world: int, persistent: bool,
                    shard: torch.Tensor | None) -> None:
        """``ds_id``, ``ds_shape``, ``ds_numel``, ``partition_numel()``, ``ds_persist`` and ``ds_tensor``."""
        tag_deepspeed(p, shape, world)  # ``hasattr(p, "ds_id")``: how scripts tell a ZeRO-3 parameter
        p.ds_persist = persistent  # type: ignore[attr-defined]  # DeepSpeed's: never released
        if shard is not None:  # DeepSpeed's name for this rank's (padded) partition; a view
            p.ds_tensor = shard  # type: ignore[attr-defined]
        elif hasattr(p, "ds_tensor"):  # in the swap file: zero.Init's chunk must not stay alive through it
            del p.ds_tensor  # type: ignore[attr-defined]

    def state_changed(self, params: Iterable[torch.nn.Parameter], state: UnitState) -> None:
        """``ds_status``: AVAILABLE when gathered, INFLIGHT while gathering, NOT_AVAILABLE at rest."""
        status = _STATUS[state]
        for p in params:
            p.ds_status = status  # type: ignore[attr-defined]


#: the observer ``initialize`` gives every stage
DEEPSPEED_PARAM_ATTRS = DeepSpeedParamAttrs()
