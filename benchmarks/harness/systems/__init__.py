"""One module per system, each with the same two functions.

- ``import_library()``: import what the system needs beyond torch (timed by the worker);
- ``build(model, job, device) -> Trainer``: wrap the model and optimizer (timed as "initialize").
"""

from __future__ import annotations

import importlib
from types import ModuleType

from benchmarks.harness.spec import SYSTEMS

_MODULES = {
    "zeroshard": "benchmarks.harness.systems.zeroshard_system",
    "zeroshard_reshard": "benchmarks.harness.systems.zeroshard_reshard",
    "deepspeed": "benchmarks.harness.systems.deepspeed_system",
    "ddp": "benchmarks.harness.systems.ddp",
    "zero_redundancy": "benchmarks.harness.systems.zero_redundancy",
    "fsdp2": "benchmarks.harness.systems.fsdp2",
}
assert set(_MODULES) == set(SYSTEMS)


def get_system(name: str) -> ModuleType:
    """The module implementing system ``name``."""
    return importlib.import_module(_MODULES[name])
