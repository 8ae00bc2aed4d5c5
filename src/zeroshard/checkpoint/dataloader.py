"""A data loader whose position survives a checkpoint, at the same or another world size.

:class:`ResumableDistributedSampler` draws exactly the indices ``DistributedSampler`` draws (same
seed, epoch-dependent permutation, padding), but can start at any position of the epoch, counted
in *global* samples: with ``N`` ranks and micro batch ``b``, after ``k`` batches per rank the
first ``k·b·N`` entries of the epoch's permutation are consumed, whatever ``N`` was. A resume at
``M`` ranks deals the remaining entries round-robin over ``M`` ranks, so every sample of the epoch
is still seen exactly once (at the same world size, the very same batches follow).

:class:`ResumableDataLoader` counts the batches it hands out and reports the position as
``state_dict()``; ``initialize(training_data=...)`` returns one and links it to the engine (by
the engine's config object), so ``save_checkpoint`` records it and ``load_checkpoint`` restores it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

logger = logging.getLogger("zeroshard")



class ResumableDistributedSampler(DistributedSampler):  # type: ignore[type-arg]
    """``DistributedSampler`` that can start mid-epoch (``start`` = global samples consumed)."""

    def __init__(self, dataset: Any, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.start = 0

    def _remaining(self) -> list[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        if self.drop_last:
            rest = order[self.start : n - n % self.num_replicas]
            return rest[: len(rest) - len(rest) % self.num_replicas]
        rest = order[self.start :]
        pad = -len(rest) % self.num_replicas
        while pad > 0:  # DistributedSampler pads by repeating the epoch's first indices
            rest += order[: min(pad, n)]
            pad -= min(pad, n)
        return rest

    def __iter__(self) -> Iterator[int]:
        return iter(self._remaining()[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.drop_last:
            return max(n - n % self.num_replicas - self.start, 0) // self.num_replicas
        return -(-max(n - self.start, 0) // self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; moving to another epoch starts it from its beginning."""
        if epoch != self.epoch:
            self.start = 0
        super().set_epoch(epoch)


class ResumableDataLoader(DataLoader):  # type: ignore[type-arg]
    """A ``DataLoader`` over a :class:`ResumableDistributedSampler` that knows its position."""

    def __init__(self, dataset: Any, batch_size: int, sampler: ResumableDistributedSampler, **kwargs: Any) -> None:
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, **kwargs)
        self._consumed = 0
        self._next: Iterator[Any] | None = None

    @property
    def resumable_sampler(self) -> ResumableDistributedSampler:
        """The sampler (typed)."""
        assert isinstance(self.sampler, ResumableDistributedSampler)
        return self.sampler

    @property
    def data_sampler(self) -> ResumableDistributedSampler:
        """The sampler, by DeepSpeed's loader's name (``loader.data_sampler.set_epoch(epoch)``)."""
        return self.resumable_sampler

    @property
    def len(self) -> int:
        """Batches per epoch, by DeepSpeed's loader's attribute name (``loader.len``)."""
        return len(self)

    @property
    def num_local_io_workers(self) -> int:
        """Worker processes loading batches, by DeepSpeed's name (zeroshard loads in the training process: 0)."""
        return int(self.num_workers)

    @property
    def dataloader_drop_last(self) -> bool:
        """Whether the last partial batch is dropped, by DeepSpeed's loader's attribute name."""
        return bool(self.drop_last)

    def __next__(self) -> Any:
        """The next batch, as DeepSpeed's loader, which is its own iterator (``next(loader)``); a
        ``for`` loop or ``iter(loader)`` starts a pass of its own, and the next ``next`` after it too."""
        if self._next is None:
            self._next = self._batches()
        return next(self._next)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self._next = None
        return self._batches()

    def _batches(self) -> Iterator[Any]:
        sampler = self.resumable_sampler
        self._consumed = sampler.start
        step = int(self.batch_size or 1) * sampler.num_replicas
        if sampler.start > 0:
            # Creating an iterator draws its base seed from torch's global generator; an uninterrupted
            # run drew it when the epoch began, before the checkpoint captured the RNG state. Drawing
            # again here would shift every later random number (dropout masks...), so put it back.
            state = torch.get_rng_state()
            batches = super().__iter__()
            torch.set_rng_state(state)
        else:
            batches = super().__iter__()
        for batch in batches:
            self._consumed += step
            yield batch
        sampler.start = 0  # the epoch is complete; the next one starts from its beginning
        self._consumed = 0

    def state_dict(self) -> dict[str, Any]:
        """Position: epoch and global samples consumed in it (plain numbers)."""
        s = self.resumable_sampler
        return {"epoch": int(s.epoch), "consumed": int(min(self._consumed, len(self.dataset))),  # type: ignore[arg-type]
                "seed": int(s.seed), "shuffle": bool(s.shuffle), "dataset_len": len(self.dataset)}  # type: ignore[arg-type]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a :meth:`state_dict` position; the next iteration continues from there."""
        s = self.resumable_sampler
        if int(state["dataset_len"]) != len(self.dataset) or bool(state["shuffle"]) != s.shuffle:  # type: ignore[arg-type]
            logger.warning("data loader position not restored: the checkpoint's dataset/shuffle (%s) differ "
                           "from this loader's", state)
            return
        s.epoch, s.seed, s.start = int(state["epoch"]), int(state["seed"]), int(state["consumed"])
        self._consumed = s.start
