"""What the FLOPs profiler measured: the module tree of one step and the whole-model figures."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class ModuleProfile:
    """One module's share of the profiled step's forwards."""

    name: str  #: attribute path from the model (``blocks.0.attn``; ``""`` for the model)
    kind: str  #: class name
    depth: int  #: 0 for the model
    params: int  #: trainable parameters, whole (also while ZeRO-3 holds only a shard)
    flops: int  #: forward FLOPs, children included
    duration: float  #: forward seconds, summed over calls (children's sum for a never-called container)
    children: list[ModuleProfile] = field(default_factory=list)

    def walk(self) -> Iterator[ModuleProfile]:
        """This module and its descendants, depth first."""
        yield self
        for c in self.children:
            yield from c.walk()


@dataclass
class StepProfile:
    """The profiled step: the module tree and the whole-model figures."""

    step: int
    model: ModuleProfile
    world_size: int
    micro_batch: int
    fwd_latency: float  #: seconds in the model's forwards
    iter_latency: float  #: seconds from the first forward of the step to the end of ``step()``
    flops_factor: float  #: step FLOPs / forward FLOPs (3 + recompute_fwd_factor)
    peak: float | None  #: peak FLOP/s per device, ``None`` when unknown
    peak_source: str

    @property
    def fwd_flops(self) -> int:
        """Forward FLOPs of the step on this rank."""
        return self.model.flops

    @property
    def flops_per_s(self) -> float:
        """Achieved FLOP/s per device over the step (forward, backward and optimizer step)."""
        return self.flops_factor * self.fwd_flops / self.iter_latency if self.iter_latency > 0 else 0.0

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation: achieved FLOP/s / peak (``None`` when the peak is unknown)."""
        return self.flops_per_s / self.peak if self.peak else None
