"""A small pool of aligned host buffers for swap-file reads and writes.

Buffers are allocated on first use, up to ``count`` of them, each of ``numel`` elements, and
reused; page-locked when pinning applies (allocating page-locked memory is slow, so reuse matters).
When every pooled buffer is taken, :meth:`BufferPool.acquire` hands out a temporary one instead of
waiting (a wait could deadlock on a holder that only the waiting thread would release); it is
freed on release. :attr:`BufferPool.nbytes` is what the pool holds, for ``memory_usage()``.
"""

from __future__ import annotations

import torch

from zeroshard.core.offload.aio import aligned_empty

__all__ = ["BufferPool"]


class BufferPool:
    """Up to ``count`` reusable aligned host buffers of ``numel`` elements of ``dtype``."""

    def __init__(self, count: int, numel: int, dtype: torch.dtype, pin: bool) -> None:
        self.count = count
        self.numel = numel
        self.dtype = dtype
        self.pin = pin
        self._free: list[torch.Tensor] = []
        self._owned: set[int] = set()
        self.temporary = 0  # buffers handed out beyond the pool, for reports

    def acquire(self) -> torch.Tensor:
        """A buffer of :attr:`numel` elements (pooled when one is free or may still be made)."""
        if self._free:
            return self._free.pop()
        if len(self._owned) < self.count:
            buf = aligned_empty(self.numel, self.dtype, pin=self.pin)
            self._owned.add(buf.data_ptr())
            return buf
        self.temporary += 1
        return aligned_empty(self.numel, self.dtype)

    def release(self, buf: torch.Tensor) -> None:
        """Give a buffer back (a temporary one is simply dropped)."""
        if buf.data_ptr() in self._owned:
            self._free.append(buf)

    @property
    def exhausted(self) -> bool:
        """Whether :meth:`acquire` would hand out a temporary buffer."""
        return not self._free and len(self._owned) >= self.count

    @property
    def nbytes(self) -> int:
        """Bytes of the pooled buffers allocated so far."""
        return len(self._owned) * self.numel * self.dtype.itemsize

    def clear(self) -> None:
        """Drop the free buffers (those handed out are dropped when released)."""
        self._free.clear()
        self._owned.clear()
