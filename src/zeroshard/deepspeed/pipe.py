"""DeepSpeed's ``deepspeed.pipe`` names, for scripts that import them: pipeline parallelism is outside
zeroshard's scope (ZeRO data parallelism only).

``deepspeed.pipe`` (through :mod:`zeroshard.deepspeed.imports`) and ``zeroshard.pipe`` (``import zeroshard
as deepspeed``) are this module. The names import, so a script that imports them at top level and
trains without a pipeline runs (DeepSpeedExamples' ``pipeline_parallelism/train.py -p 0``); building a
:class:`PipelineModule` or a layer spec raises :class:`~zeroshard.errors.NotYetSupportedError`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from zeroshard.errors import NotYetSupportedError

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]


def _refuse(ds_name: str) -> NotYetSupportedError:
    return NotYetSupportedError(
        f"{ds_name}: pipeline parallelism (DeepSpeed's deepspeed.pipe) is not supported by zeroshard, which "
        "shards a data-parallel model with ZeRO; build the model as one nn.Module and train it with ZeRO "
        "stage 3 (parameters sharded across ranks) instead", key="pipeline")


class PipelineModule(nn.Module):
    """DeepSpeed's ``deepspeed.pipe.PipelineModule``: constructing one raises (``isinstance`` checks work)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _refuse("deepspeed.pipe.PipelineModule")


class LayerSpec:
    """DeepSpeed's ``deepspeed.pipe.LayerSpec``: constructing one raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _refuse(f"deepspeed.pipe.{type(self).__name__}")


class TiedLayerSpec(LayerSpec):
    """DeepSpeed's ``deepspeed.pipe.TiedLayerSpec``: constructing one raises."""
