"""Named RNG states for model-parallel dropout (Megatron's ``get_cuda_rng_tracker``), device-agnostic.

Dropout inside a tensor-parallel region must draw different masks on each model-parallel rank, and
the same masks on each data-parallel replica; outside it, the reverse. Megatron keeps a second,
named generator state for the former and switches to it with ``tracker.fork()``. The states are
those of the accelerator's default generator (CUDA when present, else the CPU's), so the same
code runs on CPU.

Recomputation must see the states the forward saw: :func:`~zeroshard.activations.checkpoint`
snapshots :meth:`RNGStatesTracker.get_states` at the start of each checkpointed forward and
restores it around the recomputation (torch's ``preserve_rng_state`` covers the default generators).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch

from zeroshard.activations import settings

__all__ = ["MODEL_PARALLEL_RNG", "RNGStatesTracker", "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed"]

MODEL_PARALLEL_RNG = "model-parallel-rng"
"""The tracker's state for model-parallel regions (DeepSpeed's and Megatron's name)."""


def _get_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class RNGStatesTracker:
    """Named generator states; :meth:`fork` runs a block on one of them and saves where it got to."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        """Forget every state and seed."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the name → state mapping (the states themselves are replaced, never mutated)."""
        return copy.copy(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the states (as returned by :meth:`get_states`)."""
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """Create state ``name`` seeded with ``seed``; a seed or name used before is an error."""
        if seed in self.seeds_:
            raise ValueError(f"RNG tracker: seed {seed} is already used")
        if name in self.states_:
            raise ValueError(f"RNG tracker: state {name!r} already exists")
        self.seeds_.add(seed)
        original = _get_state()
        _manual_seed(seed)
        self.states_[name] = _get_state()
        _set_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block on state ``name``; afterwards the default state is as before the block."""
        if name not in self.states_:
            raise KeyError(f"RNG tracker: state {name!r} was not added (call model_parallel_cuda_manual_seed)")
        original = _get_state()
        _set_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_state()
            _set_state(original)


_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (DeepSpeed's ``get_cuda_rng_tracker``; CPU generator when no CUDA)."""
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generator with ``seed`` (same on data-parallel replicas) and the tracker's
    model-parallel state with ``seed + 2718 + model-parallel rank`` (different on each
    model-parallel rank), as DeepSpeed and Megatron do. The rank comes from the ``mpu`` given to
    :func:`zeroshard.deepspeed.checkpointing.configure` (0 without one)."""
    _TRACKER.reset()
    _manual_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + 2718 + settings.current().mp_rank)
