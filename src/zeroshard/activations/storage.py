"""Where the inputs of a checkpointed region wait for its recomputation: whole, partitioned across the
model-parallel group, and/or in host memory.

A non-reentrant ``torch.utils.checkpoint`` keeps only its region's inputs (saved through autograd's
saved-tensor mechanism before the region's own hooks take over); :func:`saved_inputs` installs
pack/unpack hooks around that save:

- pack (forward): keep the tensor, or this rank's 1/N slice of it (``partition_activations``),
  on the host (``cpu_checkpointing``) or where it was;
- unpack (backward, when the region is recomputed): move it back and all-gather the slices over
  the model-parallel group, on the tensor's own device.

An input marked for an active activation offload (``offload.py``, DeepSpeed's
``CheckpointHiddenStatesOffload``) is handed to it instead: these hooks are the innermost, so the
offload's own would never see the input.

Partitioning is only correct when every rank of the group holds the *same* input, as tensor
parallelism guarantees for the activations between its layers; data-parallel ranks hold different
activations and cannot partition them. The first partitioned input after each configuration is
checked to be identical across the group (one small all-gather), so a wrong ``mpu`` fails loudly
rather than training on someone else's activations.

Each packed input is counted in :data:`STATS` while it is held, for ``profile`` and for measuring.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from zeroshard.activations import settings as _settings
from zeroshard.activations.offload import OffloadedTensorRef, current_offload
from zeroshard.activations.settings import Settings
from zeroshard.core.comm import collectives as C
from zeroshard.errors import DistributedError

__all__ = ["STATS", "SavedInputStats", "saved_inputs"]

_SAMPLES = 64  # elements compared by the same-input check


@dataclass
class SavedInputStats:
    """Bytes of checkpointed inputs held for backward by this process (all packed inputs)."""

    live_bytes: int = 0
    """Held now."""
    peak_bytes: int = 0
    """Most held at once since the last :meth:`reset`."""
    host_bytes: int = 0
    """Held now in host memory."""
    packed: int = 0
    """Inputs packed since the last :meth:`reset`."""
    gathered: int = 0
    """Partitioned inputs all-gathered since the last :meth:`reset`."""

    def reset(self) -> None:
        """Zero the counters (``live_bytes`` and ``host_bytes`` keep what is held now)."""
        self.peak_bytes, self.packed, self.gathered = self.live_bytes, 0, 0

    def _add(self, nbytes: int, host: bool) -> None:
        self.live_bytes += nbytes
        self.host_bytes += nbytes if host else 0
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.packed += 1

    def _drop(self, nbytes: int, host: bool) -> None:
        self.live_bytes -= nbytes
        self.host_bytes -= nbytes if host else 0


STATS = SavedInputStats()
"""The process's counters (checkpointing itself is process-wide, see ``settings.py``)."""


class Packed:
    """One held input: ``data`` (the whole tensor, or this rank's padded 1/N slice) and how to restore it."""

    def __init__(self, data: torch.Tensor, device: torch.device, shape: torch.Size | None,
                 aliased: bool = False) -> None:
        self.data = data
        self.device = device
        self.shape = shape  # the full shape when ``data`` is a slice; None when it is the whole tensor
        # ``data`` shares the input's storage (and version counter): an in-place change to the input
        # after forward would silently change the recomputation, so it is detected at unpack, as
        # autograd does for the tensors it saves itself.
        self.version = data._version if aliased else None
        if data.numel() == 0:
            return  # some torch versions save an empty placeholder with the inputs: not an input
        nbytes, host = data.numel() * data.element_size(), data.device.type == "cpu"
        STATS._add(nbytes, host)
        # Counted out when autograd drops the saved input (after its unpack, or with the graph).
        weakref.finalize(self, STATS._drop, nbytes, host)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t  # already in host memory: cpu_checkpointing has nothing to move on a CPU run
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    # Non-blocking into pinned memory on the current stream: the unpack's copy back is queued after
    # it on the same stream, and the host side never reads the buffer.
    return host.copy_(t, non_blocking=True)


def _partitionable(t: torch.Tensor, s: Settings) -> bool:
    # DeepSpeed's rule: floating-point tensors with at least one element per rank.
    return s.partitions and t.is_floating_point() and t.numel() >= s.mp_size


def _check_same_input(flat: torch.Tensor, s: Settings) -> None:
    """Every rank of the group must hold the same input; compare its size and a strided sample."""
    step = max(1, flat.numel() // _SAMPLES)
    row = torch.zeros(_SAMPLES + 1, dtype=torch.float64, device=C.control_device(s.group))
    sample = flat[::step][:_SAMPLES].detach().to(row.device, torch.float64)
    row[0], row[1 : 1 + sample.numel()] = flat.numel(), sample
    rows = torch.empty(s.mp_size * row.numel(), dtype=row.dtype, device=row.device)
    work = C.all_gather(rows, row, s.group, what="partition_activations same-input check")
    if work is not None:
        work.wait()
    rows = rows.view(s.mp_size, -1).view(torch.int64)  # compare bits: NaN equals NaN here
    differ = [r for r in range(s.mp_size) if not torch.equal(rows[r], rows[s.mp_rank])]
    if differ:
        raise DistributedError(
            "activation_checkpointing.partition_activations: the checkpointed input differs between "
            f"model-parallel ranks {s.mp_rank} and {differ} of the mpu's group. Partitioning needs the same "
            "input on every rank of that group (tensor-parallel activations); data-parallel ranks hold "
            "different activations. Check the mpu given to zeroshard.deepspeed.checkpointing.configure, or disable it.")


class _SameInputCheck:
    done_for = -1  # the configuration generation already checked


def _pack(t: torch.Tensor, s: Settings) -> Packed:
    device = t.device
    if not _partitionable(t, s):
        data = t.detach()
        held = _to_host(data) if s.cpu_checkpointing else data
        return Packed(held, device, None, aliased=held is data)
    flat = t.detach().reshape(-1)
    if _SameInputCheck.done_for != _settings.generation():
        _check_same_input(flat, s)
        _SameInputCheck.done_for = _settings.generation()
    chunk = -(-flat.numel() // s.mp_size)
    start = min(s.mp_rank * chunk, flat.numel())
    piece = flat[start : start + chunk]
    shard = torch.zeros(chunk, dtype=flat.dtype, device=device)  # the last rank's slice may be short
    shard[: piece.numel()].copy_(piece)
    return Packed(_to_host(shard) if s.cpu_checkpointing else shard, device, t.shape)


def _unpack(p: Packed, s: Settings) -> torch.Tensor:
    if p.version is not None and p.data._version != p.version:
        raise RuntimeError(
            "an input of a checkpointed region (zeroshard.deepspeed.checkpointing.checkpoint) was modified in place "
            f"after the region's forward (version {p.version}, now {p.data._version}); the recomputation "
            "would not see the value the forward saw. Clone it before modifying it.")
    data = p.data.to(p.device, non_blocking=True)
    if p.shape is None:
        return data
    full = torch.empty(s.mp_size * data.numel(), dtype=data.dtype, device=p.device)
    work = C.all_gather(full, data, s.group, what="partition_activations all-gather")
    if work is not None:
        work.wait()
    STATS.gathered += 1
    return full[: p.shape.numel()].view(p.shape)


@contextlib.contextmanager
def saved_inputs(s: Settings) -> Iterator[None]:
    """Pack the tensors autograd saves in this block as ``s`` says (see the module docstring).

    The settings are bound now, so a region is recomputed with the group it was packed for.
    """
    def pack(t: torch.Tensor) -> Packed | OffloadedTensorRef:
        # an input marked for an active activation offload (offload.py) goes there: these hooks hide
        # the offload's own, which would otherwise never see it
        offload = current_offload()
        ref = offload.pack_marked(t) if offload is not None else None
        return ref if ref is not None else _pack(t, s)

    def unpack(p: Packed | OffloadedTensorRef) -> torch.Tensor:
        return p.unpack() if isinstance(p, OffloadedTensorRef) else _unpack(p, s)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield

