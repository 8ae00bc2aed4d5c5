"""Profiling: the FLOPs profiler (``flops_profiler``).

- :mod:`.flops`: counts (``torch.utils.flop_counter``) and times the forwards of one step;
- :mod:`.profile`: what it measured (the module tree, FLOP/s, MFU);
- :mod:`.text`: DeepSpeed's report layout, to the log or ``output_file``;
- :mod:`.peaks`: peak FLOP/s of known accelerators for the MFU.

The communication logger (``comms_logger``) is :mod:`zeroshard.monitor.comms`.
"""

from zeroshard.profiling.flops import FlopsProfiler, RunInfo
from zeroshard.profiling.profile import ModuleProfile, StepProfile
from zeroshard.profiling.text import format_profile

__all__ = ["FlopsProfiler", "ModuleProfile", "RunInfo", "StepProfile", "format_profile"]
