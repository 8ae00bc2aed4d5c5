"""DeepSpeed's ``deepspeed.runtime.zero.utils``: the ZeRO runtime error type.

DeepSpeed raises :class:`ZeRORuntimeException` for two set-ups zeroshard supports, so zeroshard never
raises it: a client torch optimizer with ZeRO-Offload while ``zero_force_ds_cpu_optimizer`` is true
(zeroshard steps any torch optimizer on host tensors), and loading ZeRO-1/2 optimizer states saved at
another data-parallel world size without ``elastic_checkpoint`` (zeroshard reshards every checkpoint).
It exists so that ``except ZeRORuntimeException`` and ``pytest.raises(ZeRORuntimeException)`` import.
"""

from __future__ import annotations

from zeroshard.errors import ZeroshardError

__all__ = ["ZeRORuntimeException"]


class ZeRORuntimeException(ZeroshardError):
    """DeepSpeed's ZeRO runtime error (never raised by zeroshard, see the module documentation)."""
