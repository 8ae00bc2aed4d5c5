"""Where a rank's training state lives: one decision, taken in ``initialize`` from the config.

``zero_optimization.offload_optimizer.device`` places the fp32 master weights and the optimizer
state (and with them the optimizer step); ``offload_param.device`` places ZeRO-3's parameter
shards. ``none`` is the training device, ``cpu`` host memory (page-locked when ``pin_memory`` and
an accelerator is present), ``nvme`` swap files under ``nvme_path``, read and written
``sub_group_size`` elements at a time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeroshard.errors import ConfigError

__all__ = ["AioSettings", "OffloadPolicy", "Residency"]

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
    #: elements per optimizer-step sub-group (the unit of swapping and of step/copy overlap)
    sub_group_size: int = 1_000_000_000
    aio: AioSettings = AioSettings()

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
        sub_group = int(z.sub_group_size) if z.sub_group_size > 0 else 1_000_000_000
        return cls(
            optimizer=optimizer, params=params, optimizer_nvme_path=oo.nvme_path, param_nvme_path=op.nvme_path,
            pin_memory=bool(oo.pin_memory), param_pin_memory=bool(op.pin_memory),
            buffer_count=int(oo.buffer_count), param_buffer_count=int(op.buffer_count),
            param_buffer_size=int(op.buffer_size), sub_group_size=sub_group,
            aio=AioSettings(int(cfg.aio.block_size), int(cfg.aio.queue_depth), int(cfg.aio.intra_op_parallelism)),
        )


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
