"""DeepSpeed's ``RepeatingLoader`` (``deepspeed.utils``, ``deepspeed.runtime.dataloader``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["RepeatingLoader"]


class RepeatingLoader:
    """Iterate ``loader`` for ever: when it is exhausted, start it again (a ``DistributedSampler``
    keeps its epoch unless the script calls ``set_epoch``), as DeepSpeed's does."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
