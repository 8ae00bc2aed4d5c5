"""Where a rank's training state lives: one decision, taken in ``initialize`` from the config.

``zero_optimization.offload_optimizer.device`` places the fp32 master weights and the optimizer
state (and with them the optimizer step); ``offload_param.device`` places ZeRO-3's parameter
shards. ``none`` is the training device, ``cpu`` host memory (page-locked when ``pin_memory`` and
an accelerator is present), ``nvme`` swap files under ``nvme_path``, read and written
``sub_group_size`` elements at a time. ``offload_optimizer.ratio`` below 1 (ZeRO-Offload++'s
partial offload, stage 3 with ``device: cpu``) keeps the leading sub-groups' masters and optimizer
state on the training device and offloads the rest (:func:`device_subgroups`: DeepSpeed's rule).

When the config does not set ``sub_group_size``, an NVMe run chooses it
(:func:`resolve_sub_group_size`): sub-groups small enough that the swap buffers hold at most a
quarter of what the rank's optimizer state would hold in memory. DeepSpeed's default (1e9) would
make one sub-group of the whole shard, so that the buffers hold all of it and NVMe saves nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from zeroshard.errors import ConfigError

__all__ = ["AioSettings", "OffloadPolicy", "Residency", "device_subgroups", "resolve_sub_group_size", "swap_slots"]

_Z = "zero_optimization"


class Residency(enum.Enum):
    """Where one kind of state lives."""

    DEVICE = "device"
    """The training device (the accelerator; the CPU when training on CPU)."""
    HOST = "host"
    """Host memory, page-locked when pinning applies."""
    FILE = "file"
    """Swap files under an NVMe path, read into host buffers when needed."""


_FROM_CONFIG = {"none": Residency.DEVICE, "cpu": Residency.HOST, "nvme": Residency.FILE}


@dataclass(frozen=True)
class AioSettings:
    """DeepSpeed's ``aio`` block: how swap files are read and written."""

    block_size: int = 1 << 20
    queue_depth: int = 8
    threads: int = 1


@dataclass(frozen=True)
class OffloadPolicy:
    """The residency of master weights + optimizer state and of ZeRO-3 parameter shards."""

    optimizer: Residency = Residency.DEVICE
    params: Residency = Residency.DEVICE
    optimizer_nvme_path: Path | None = None
    param_nvme_path: Path | None = None
    pin_memory: bool = True
    param_pin_memory: bool = True
    #: sub-group buffers the optimizer swapper keeps (at least 2: read ahead while stepping)
    buffer_count: int = 4
    param_buffer_count: int = 5
    #: elements of each parameter swap buffer (a unit larger than this is an error at set-up)
    param_buffer_size: int = 100_000_000
    #: elements per optimizer-step sub-group (the unit of swapping and of step/copy overlap);
    #: ``None`` when the config leaves it unset: chosen from the shard (:func:`resolve_sub_group_size`)
    sub_group_size: int | None = None
    #: ``sub_group_size`` was chosen from the shard (unset in the config): so is the number of buffers
    auto_sub_group: bool = False
    aio: AioSettings = AioSettings()
    #: ``offload_optimizer.ratio``: the fraction of the optimizer's sub-groups offloaded (DeepSpeed's
    #: meaning); below 1 with ``optimizer`` in host memory, the others stay on the training device
    ratio: float = 1.0

    @property
    def sub_group(self) -> int:
        """Elements per sub-group: ``sub_group_size`` as resolved for the shard by the builder
        (:meth:`for_shard`), DeepSpeed's default before that."""
        return DEFAULT_SUB_GROUP_SIZE if self.sub_group_size is None else self.sub_group_size

    def for_shard(self, shard_numel: int) -> OffloadPolicy:
        """This policy with ``sub_group_size`` resolved for a rank holding ``shard_numel`` elements."""
        size = resolve_sub_group_size(self.sub_group_size, shard_numel, self.buffer_count,
                                      self.optimizer is Residency.FILE)
        return replace(self, sub_group_size=size, auto_sub_group=self.sub_group_size is None)

    @property
    def partial(self) -> bool:
        """Partial optimizer offload (ZeRO-Offload++'s "Twin-Flow"): the masters and optimizer state
        of the leading sub-groups stay on the training device, the others are in host memory."""
        return self.optimizer is Residency.HOST and self.ratio < 1.0

    def subgroup_residencies(self, count: int) -> tuple[Residency, ...]:
        """Where each of ``count`` optimizer sub-groups (in layout order) keeps its masters and
        optimizer state: all at :attr:`optimizer`, or with :attr:`partial` the first
        :func:`device_subgroups` on the device and the rest in host memory."""
        if not self.partial:
            return (self.optimizer,) * count
        kept = device_subgroups(self.ratio, count)
        return (Residency.DEVICE,) * kept + (Residency.HOST,) * (count - kept)

    @property
    def offloads_optimizer(self) -> bool:
        """Whether masters and optimizer state live off the training device."""
        return self.optimizer is not Residency.DEVICE

    @classmethod
    def from_config(cls, cfg: Any) -> OffloadPolicy:
        """Build the policy from a validated :class:`~zeroshard.config.ZeroshardConfig`.

        Raises:
            ConfigError: naming the key, for what the config loader cannot check alone (GPUDirect
                Storage, too few buffers); stages and paths are checked when the config is loaded.
        """
        z = cfg.zero_optimization
        oo, op = z.offload_optimizer, z.offload_param
        optimizer, params = _FROM_CONFIG[oo.device], _FROM_CONFIG[op.device]
        if cfg.aio.use_gds:
            raise ConfigError("GPUDirect Storage (aio.use_gds) is not supported: swap files are read into "
                              "host buffers", key="aio.use_gds")
        if optimizer is Residency.FILE and oo.buffer_count < 2:
            raise ConfigError(f"buffer_count {oo.buffer_count} is too small for NVMe optimizer offload: at least "
                              "2 sub-group buffers are needed (one stepped while the next is read)",
                              key=f"{_Z}.offload_optimizer.buffer_count")
        if params is Residency.FILE and op.buffer_count < 1:
            raise ConfigError("buffer_count must be at least 1 for NVMe parameter offload",
                              key=f"{_Z}.offload_param.buffer_count")
        chosen = "sub_group_size" in z.model_fields_set and z.sub_group_size > 0
        sub_group = int(z.sub_group_size) if chosen else None
        return cls(
            optimizer=optimizer, params=params, optimizer_nvme_path=oo.nvme_path, param_nvme_path=op.nvme_path,
            pin_memory=bool(oo.pin_memory), param_pin_memory=bool(op.pin_memory),
            buffer_count=int(oo.buffer_count), param_buffer_count=int(op.buffer_count),
            param_buffer_size=int(op.buffer_size), sub_group_size=sub_group,
            aio=AioSettings(int(cfg.aio.block_size), int(cfg.aio.queue_depth), int(cfg.aio.intra_op_parallelism)),
            ratio=float(oo.ratio),
        )


def device_subgroups(ratio: float, count: int) -> int:
    """How many of ``count`` sub-groups partial offload keeps on the device: the first
    ``int((1 - ratio) * count)``, DeepSpeed 0.19.8's rule to the float rounding
    (``runtime/zero/stage3.py``, ``_create_fp32_partitions``: sub-group ``i`` goes to the CPU when
    ``i >= int((1 - ratio) * count)``). ``ratio`` is the fraction *offloaded*; the product is
    truncated, so 10 sub-groups at ratio 0.9 keep none (``(1 - 0.9) * 10`` is 0.9999999999999998)
    and 3 at ratio 0.5 keep one."""
    return int((1 - ratio) * count)


#: DeepSpeed's default ``sub_group_size``, used where no swap files size it
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000
#: with ``sub_group_size`` unset, the swap buffers hold at most 1/SHARE of the in-memory state
AUTO_SWAP_SHARE = 4
#: smallest sub-group chosen (256 KiB of fp32 per state): smaller ones cost I/O calls, not memory
MIN_AUTO_SUB_GROUP = 1 << 16


def resolve_sub_group_size(requested: int | None, shard_numel: int, buffer_count: int, nvme: bool) -> int:
    """The sub-group size a rank steps with: ``requested`` when the config sets it; otherwise,
    with NVMe optimizer offload, the size at which ``buffer_count`` sub-group buffers hold at most
    ``1/AUTO_SWAP_SHARE`` of the rank's ``shard_numel`` elements of state (and DeepSpeed's default
    where nothing is swapped: in memory, sub-groups only pace the step)."""
    if requested is not None:
        return requested
    if not nvme:
        return DEFAULT_SUB_GROUP_SIZE
    return max(MIN_AUTO_SUB_GROUP, shard_numel // (AUTO_SWAP_SHARE * max(1, buffer_count)))


def swap_slots(buffer_count: int, subgroups: list[int], auto: bool) -> int:
    """Sub-group buffers of an NVMe optimizer store over sub-groups of ``subgroups`` elements:
    ``buffer_count``, at most one per sub-group. With ``sub_group_size`` chosen (``auto``), also
    as few as keep the buffers (each as large as the largest sub-group: a parameter larger than a
    sub-group is one of its own, an embedding) within a quarter of the shard, but never fewer than
    two, one stepped while the next is read."""
    slots = max(1, min(buffer_count, len(subgroups)))
    if auto and subgroups:
        fit = sum(subgroups) // AUTO_SWAP_SHARE // max(1, max(subgroups))
        slots = min(slots, max(2, fit))
    return slots


def host_device() -> torch.device:
    """Where host-resident state lives."""
    return torch.device("cpu")


def state_device(residency: Residency, device: torch.device) -> torch.device:
    """The device tensors of ``residency`` are kept on while in memory (FILE: their host buffers)."""
    return device if residency is Residency.DEVICE else host_device()


def should_pin(pin: bool, device: torch.device) -> bool:
    """Page-locked host memory only helps (and only exists) with an accelerator."""
    return pin and device.type != "cpu" and torch.cuda.is_available()


def place_of(t: torch.Tensor) -> str:
    """Where ``t``'s bytes are, in the names of ``memory_placement()``: ``device``, ``pinned_host``
    or ``host``."""
    if t.device.type != "cpu":
        return "device"
    return "pinned_host" if t.numel() and t.is_pinned() else "host"


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host tensor, page-locked when ``pin``."""
    return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)
