"""ZeRO-3 parameter availability status, named as in DeepSpeed.

DeepSpeed defines ``ZeroParamStatus`` in
``deepspeed.runtime.zero.partition_parameters``; scripts compare a
parameter's ``ds_status`` against its members (for example
``p.ds_status == ZeroParamStatus.NOT_AVAILABLE`` before gathering it).
The members and values here match DeepSpeed 0.19.8.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["ZeroParamStatus"]


class ZeroParamStatus(Enum):
    """Whether a ZeRO-3 parameter's full data is present on this process."""

    # parameters are fully present and ready for use on all processes
    AVAILABLE = 1

    # parameters are either partitioned or remote in some or all process
    NOT_AVAILABLE = 2

    # parameters are being gathered
    INFLIGHT = 3
