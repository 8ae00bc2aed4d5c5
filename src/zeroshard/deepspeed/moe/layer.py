"""``deepspeed.moe.layer``: :class:`MoE`, which zeroshard does not build (see :mod:`zeroshard.deepspeed.moe`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from zeroshard.errors import NotYetSupportedError

__all__ = ["MoE", "moe_not_supported"]


def moe_not_supported(ds_name: str) -> NotYetSupportedError:
    """The error for a use of DeepSpeed's Mixture of Experts, naming the DeepSpeed name used."""
    return NotYetSupportedError(
        f"{ds_name}: Mixture of Experts (DeepSpeed's deepspeed.moe, expert parallelism) is not supported by "
        "zeroshard; its names import so that dense models in scripts that import them train, but no expert "
        "layer can be built", key="moe")


class MoE(nn.Module):
    """DeepSpeed's ``deepspeed.moe.layer.MoE``: constructing one raises :class:`NotYetSupportedError`.

    A class (an ``nn.Module`` subclass), so that ``isinstance(module, MoE)`` checks work: no module is one.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise moe_not_supported("deepspeed.moe.layer.MoE")
