"""``checkpoint(function, *args)``: DeepSpeed's activation checkpoint on torch's non-reentrant one.

Forward runs ``function`` under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: nothing
inside the region is kept, only its inputs, packed by :func:`~zeroshard.activations.storage.saved_inputs`
(whole, partitioned, or on the host). The first backward that needs one of the region's saved
tensors recomputes the region from those inputs.

Randomness: torch restores the default CPU and device generators to their forward-time states for
the recomputation (``preserve_rng_state``), so dropout draws the same masks; the recompute context
built here does the same for the named states of :func:`~zeroshard.activations.get_cuda_rng_tracker`.

ZeRO-3: the recomputation calls the region's modules again, inside backward, so their forward
pre-hooks gather their parameters again; nothing here knows about ZeRO.

``synchronize`` and ``profile`` act at the four boundaries: start and end of the forward, start and
end of the recomputation.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from zeroshard.activations import settings as _settings
from zeroshard.activations.rng import get_cuda_rng_tracker
from zeroshard.activations.settings import Settings
from zeroshard.activations.storage import saved_inputs
from zeroshard.core import device as _device

__all__ = ["checkpoint", "non_reentrant_checkpoint"]

logger = logging.getLogger("zeroshard")

#: torch's keyword options, accepted so that ``functools.partial(checkpoint, use_reentrant=...)``
#: (Hugging Face's ``gradient_checkpointing_kwargs``) works; anything else goes to ``function``.
_TORCH_OPTIONS = ("use_reentrant", "preserve_rng_state")


def _first_device(args: tuple[Any, ...]) -> torch.device:
    return next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))


@contextlib.contextmanager
def _boundary(s: Settings, dev: torch.device, what: str) -> Iterator[None]:
    """Synchronize before and after (``synchronize``) and log the time taken (``profile``)."""
    if s.synchronize or s.profile:
        _device.synchronize(dev)  # profile: time the work, not its queueing
    started = time.perf_counter()
    try:
        yield
    finally:
        if s.synchronize or s.profile:
            _device.synchronize(dev)
        if s.profile:
            logger.info("zeroshard: activation checkpoint %s: %.3f ms", what, 1e3 * (time.perf_counter() - started))


def _contexts(s: Settings, dev: torch.device) -> tuple[contextlib.AbstractContextManager[Any],
                                                       contextlib.AbstractContextManager[Any]]:
    """torch's ``context_fn``: called at the start of the forward, so the tracker states read here
    are the forward's; the recompute context runs the recomputation on them."""
    forward_states = get_cuda_rng_tracker().get_states()

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        tracker = get_cuda_rng_tracker()
        backward_states = tracker.get_states()
        tracker.set_states(dict(forward_states))
        try:
            with _boundary(s, dev, "recomputation"):
                yield
        finally:
            tracker.set_states(backward_states)

    return contextlib.nullcontext(), _Reenterable(recompute)


class _Reenterable:
    """A context manager that may be entered again, each time through a fresh ``factory()``: torch
    enters the recompute context once per recomputation, and a region is recomputed once per
    backward through it (``retain_graph``, ``autograd.grad`` then ``backward``, a gradient penalty's
    double backward), where a generator-based one fails on its second use."""

    def __init__(self, factory: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
        self._factory = factory
        self._active: list[contextlib.AbstractContextManager[Any]] = []

    def __enter__(self) -> Any:
        cm = self._factory()
        value = cm.__enter__()
        self._active.append(cm)
        return value

    def __exit__(self, *exc: Any) -> bool | None:
        return self._active.pop().__exit__(*exc)


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` keeping only its inputs; recompute it in backward.

    As ``deepspeed.checkpointing.checkpoint``: keyword arguments go to ``function`` (tensors among
    them are saved like positional ones), except torch's ``use_reentrant`` (accepted; the
    implementation is always non-reentrant, which gives the same gradients) and
    ``preserve_rng_state`` (default ``True``: the recomputation draws the forward's random numbers).
    Behaviour follows :func:`zeroshard.deepspeed.checkpointing.configure` or the config's
    ``activation_checkpointing`` block.

    Args:
        function: the region to checkpoint (a module, a module's ``__call__``, any callable).
        *args: its positional arguments.
        **kwargs: its keyword arguments.

    Returns:
        What ``function`` returns.
    """
    preserve = bool(kwargs.pop("preserve_rng_state", True))
    kwargs.pop("use_reentrant", None)
    if kwargs:  # positional for torch, so that tensors passed by keyword are saved and packed too
        keys, n = tuple(kwargs), len(args)

        def call(*all_args: Any) -> Any:
            return function(*all_args[:n], **dict(zip(keys, all_args[n:])))

        return checkpoint(call, *args, *kwargs.values(), preserve_rng_state=preserve)
    s = _settings.current()
    dev = _first_device(args)
    with _boundary(s, dev, "forward"), saved_inputs(s):
        return _torch_checkpoint(function, *args, use_reentrant=False, preserve_rng_state=preserve,
                                 context_fn=functools.partial(_contexts, s, dev))


non_reentrant_checkpoint = checkpoint
"""DeepSpeed's name for its non-reentrant variant; :func:`checkpoint` is non-reentrant already."""
