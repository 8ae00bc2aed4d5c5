"""Memory estimates and configuration planning.

- :mod:`~zeroshard.estimate.formulas`: DeepSpeed's ``estimate_zero2_*`` / ``estimate_zero3_*``
  functions (also under :mod:`zeroshard.deepspeed.runtime.zero.stage_1_and_2` and ``stage3``).
- :func:`estimate`: zeroshard's own per-GPU and per-node bytes (host memory, NVMe swap files) for
  stages 0–3 and offload choices, with activations; :func:`plan`: the fastest configuration that
  fits, as a DeepSpeed config; :func:`placement`: one rank's bytes by kind and place for an
  :class:`Offload` choice, as ``engine.optimizer.memory_placement()`` reports them.
- Models come from a module (:func:`spec_from_module`), a factory (:func:`spec_from_factory`), a
  Hugging Face config (:func:`spec_from_hf_config`) or a count (:func:`spec_from_count`), built on
  the meta device.

``zeroshard estimate --help`` is the command-line front end. Submodules load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zeroshard.estimate.activations import ActivationEstimate, estimate_activations
    from zeroshard.estimate.hf import spec_from_hf_config
    from zeroshard.estimate.model_spec import (
        ModelSpec,
        TransformerShape,
        spec_from_count,
        spec_from_factory,
        spec_from_module,
    )
    from zeroshard.estimate.planner import Estimate, Hardware, Plan, PlanError, Row, Training, estimate, plan
    from zeroshard.estimate.residency import Offload, Placement, placement
    from zeroshard.estimate.states import Buckets, StateEstimate, model_states

_LAZY = {
    "ActivationEstimate": "activations", "estimate_activations": "activations",
    "spec_from_hf_config": "hf",
    "ModelSpec": "model_spec", "TransformerShape": "model_spec", "spec_from_count": "model_spec",
    "spec_from_factory": "model_spec", "spec_from_module": "model_spec",
    "Estimate": "planner", "Hardware": "planner", "Plan": "planner", "PlanError": "planner", "Row": "planner",
    "Training": "planner", "estimate": "planner", "plan": "planner",
    "Offload": "residency", "Placement": "residency", "placement": "residency",
    "Buckets": "states", "StateEstimate": "states", "model_states": "states",
}

__all__ = [
    "ActivationEstimate", "Buckets", "Estimate", "Hardware", "ModelSpec", "Offload", "Placement", "Plan", "PlanError",
    "Row", "StateEstimate", "Training", "TransformerShape", "estimate", "estimate_activations", "model_states",
    "placement", "plan", "spec_from_count", "spec_from_factory", "spec_from_hf_config", "spec_from_module",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
