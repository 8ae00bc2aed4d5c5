"""Offload of optimizer state and parameters to host memory or NVMe files.

Where each piece of a rank's training state lives is decided once, by an
:class:`~zeroshard.core.offload.policy.OffloadPolicy` built from the config in ``initialize``; the
stages never branch on it. Every reader and writer of master weights and optimizer state (the
step, checkpoint save and load, resharding, ``memory_usage()``) goes through a
:class:`~zeroshard.core.offload.state_store.StateStore`, which knows whether a piece is on the device,
in host memory or in a file.
"""

from zeroshard.core.offload.policy import OffloadPolicy, Residency

__all__ = ["OffloadPolicy", "Residency"]
