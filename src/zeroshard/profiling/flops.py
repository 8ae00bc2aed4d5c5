"""The FLOPs profiler (``flops_profiler``): per-module parameters, FLOPs, latency and FLOP/s of one step.

At training step ``profile_step`` (counted from 0 like DeepSpeed's ``global_steps``, so the default
1 profiles the second step, after a warm-up) and on rank 0 only, every forward of that step runs
under :class:`torch.utils.flop_counter.FlopCounterMode`, which counts each operator with torch's
own formulas and files the count under every module on the stack (a module's FLOPs include its
children's). Forward pre/post hooks on every module time it (synchronising the accelerator in
each hook, for this one step only). When the step ends, :mod:`.text` lays the result out as
DeepSpeed's profiler does: a summary with the achieved FLOP/s and the MFU against the device's
peak (:mod:`.peaks`), the top modules per depth, and the module tree.

What is counted is what torch counts: matrix products, convolutions and attention kernels that
have a formula (on CPU the SDPA kernel has none, so attention is absent there); element-wise
operations (norms, activations, softmax) are not, unlike DeepSpeed's hand-written counter.
Latencies are those of the profiled step, with the counter's Python call per operator included.
The step's FLOPs are ``(3 + recompute_fwd_factor)`` times the forward's (backward is twice the
forward), as DeepSpeed reckons.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.hooks import RemovableHandle

from zeroshard.core.device import synchronize
from zeroshard.core.partition import full_numel
from zeroshard.profiling.peaks import peak_flops
from zeroshard.profiling.profile import ModuleProfile, StepProfile
from zeroshard.profiling.text import write_profile


@dataclass(frozen=True)
class RunInfo:
    """What the profiler reports about the run besides the model."""

    world_size: int
    micro_batch: int
    device: torch.device
    compute_dtype: torch.dtype


class FlopsProfiler:
    """Profiles the forwards of step ``cfg.profile_step`` of ``module``; see the module docstring.

    Args:
        module: the model (its root is the top of the tree).
        cfg: the ``flops_profiler`` config block.
        run: world size, micro batch, device and compute dtype, for the report and the peak.
    """

    def __init__(self, module: torch.nn.Module, cfg: Any, run: RunInfo) -> None:
        self.module, self.cfg, self.run = module, cfg, run
        self.flops: dict[str, int] = defaultdict(int)  #: ModuleTracker name -> FLOPs
        self.durations: dict[int, float] = defaultdict(float)  #: id(module) -> seconds
        self._starts: dict[int, list[float]] = defaultdict(list)
        self._handles: list[RemovableHandle] = []
        self._t0: float | None = None
        #: the last profile taken (``None`` before ``profile_step``)
        self.last: StepProfile | None = None

    def forward(self, step: int) -> AbstractContextManager[None]:
        """Wrap one forward of training step ``step``: profiled at ``profile_step``, else nothing."""
        if step != self.cfg.profile_step:
            return nullcontext()
        if self._t0 is None:  # the step's first forward
            self._attach()
            synchronize(self.run.device)
            self._t0 = time.perf_counter()
        return self._counted()

    @contextmanager
    def _counted(self) -> Iterator[None]:
        counter = FlopCounterMode(display=False)
        with counter:
            yield
        for name, ops in counter.get_flop_counts().items():
            self.flops[name] += sum(ops.values())

    def step_done(self, step: int) -> StepProfile | None:
        """After ``step()`` of training step ``step``: when it was the profiled one, report it (to
        ``output_file`` or the log) and return the profile."""
        if self._t0 is None or step != self.cfg.profile_step:
            return None
        synchronize(self.run.device)
        iter_latency = time.perf_counter() - self._t0
        self._detach()
        tree = self._tree(self.module, "", type(self.module).__name__, 0)
        peak, source = peak_flops(self.cfg.peak_tflops, self.run.device, self.run.compute_dtype)
        self.last = StepProfile(step, tree, self.run.world_size, self.run.micro_batch, fwd_latency=tree.duration,
                                iter_latency=iter_latency, flops_factor=3.0 + float(self.cfg.recompute_fwd_factor),
                                peak=peak, peak_source=source)
        self._t0 = None
        self.flops.clear()
        self.durations.clear()
        write_profile(self.last, self.cfg)
        return self.last

    # -- timing hooks (attached for the profiled step only) --------------------------------------
    def _attach(self) -> None:
        for m in self.module.modules():
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._post))

    def _detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._starts.clear()

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        synchronize(self.run.device)
        self._starts[id(module)].append(time.perf_counter())

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        synchronize(self.run.device)
        starts = self._starts[id(module)]
        if starts:  # a stack: a module may call itself
            self.durations[id(module)] += time.perf_counter() - starts.pop()

    # -- the tree ----------------------------------------------------------------------------------
    def _tree(self, module: torch.nn.Module, path: str, tracker_name: str, depth: int) -> ModuleProfile:
        """The profile of ``module`` and its children. ``tracker_name`` is the name
        :class:`~torch.utils.module_tracker.ModuleTracker` files its FLOPs under (``GPT.blocks.0``)."""
        children = [self._tree(child, f"{path}.{name}" if path else name, f"{tracker_name}.{name}", depth + 1)
                    for name, child in module.named_children()]
        params = sum(full_numel(p) for p in module.parameters() if p.requires_grad)
        if id(module) in self.durations:
            flops, duration = self.flops.get(tracker_name, 0), self.durations[id(module)]
        else:  # never called (a ModuleList): its children's sums, as DeepSpeed shows containers
            flops, duration = sum(c.flops for c in children), sum(c.duration for c in children)
        return ModuleProfile(path, type(module).__name__, depth, params, flops, duration, children)
