"""The loader ``initialize(training_data=...)`` returns, side by side with DeepSpeed 0.19.8's.

Each rank gets the same samples in the same order as from DeepSpeed's loader (2 ranks, 16 samples,
micro batch 3, two epochs, with ``dataloader_drop_last`` false and true), and DeepSpeed scripts'
idioms work: ``loader.data_sampler.set_epoch(epoch)``, ``next(loader)`` (DeepSpeed's loader is its own
iterator), ``len(loader)``, and ``engine.deepspeed_io(dataset)`` collating with the ``collate_fn``
given to ``initialize``. ``dataloader_drop_last: true`` was refused before, ``data_sampler`` and
``next(loader)`` were missing, and ``deepspeed_io`` used torch's default collate.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest
import torch

from tests.harness import run_distributed

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="DeepSpeed is not installed (pip install zeroshard[deepspeed])")


class Numbers(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.tensor([float(i)])}


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {"ids": torch.cat([item["x"] for item in items])}


def loader_worker(rank: int, world: int, lib: str, drop_last: bool) -> dict[str, Any]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if lib == "deepspeed":
        import deepspeed as ds
    else:
        import zeroshard as ds
    model = torch.nn.Linear(1, 1)
    cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2, "dataloader_drop_last": drop_last,
           "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
    engine, _, loader, _ = ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                         training_data=Numbers(16), collate_fn=collate, config=cfg)
    epochs = []
    for epoch in range(2):
        loader.data_sampler.set_epoch(epoch)
        epochs.append([batch["ids"].int().tolist() for batch in loader])
    loader.data_sampler.set_epoch(0)
    iter(loader)  # DeepSpeed's loader restarts here and is then stepped by next()
    first = next(loader)["ids"].int().tolist()
    second = next(loader)["ids"].int().tolist()
    eval_loader = engine.deepspeed_io(Numbers(8), route="eval")
    return {"epochs": epochs, "len": len(loader), "len_attr": loader.len, "next": [first, second],
            "drop_last_attr": loader.dataloader_drop_last,
            "drop_last": engine.dataloader_drop_last(), "eval_keys": sorted(next(iter(eval_loader)))}


@pytest.mark.parametrize("drop_last", [False, True])
def test_loader_matches_deepspeeds(drop_last: bool) -> None:
    ours = run_distributed(loader_worker, 2, "zeroshard", drop_last)
    theirs = run_distributed(loader_worker, 2, "deepspeed", drop_last)
    assert ours == theirs
    assert ours[0]["eval_keys"] == ["ids"]  # collated by the initialize collate_fn, as DeepSpeed does
    assert ours[0]["epochs"][0] != ours[0]["epochs"][1]  # set_epoch reshuffled
    assert ours[0]["len"] == (2 if drop_last else 3)  # 8 samples per rank in micro batches of 3


class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(torch.arange(8.0).unsqueeze(1))


def iterable_worker(rank: int, world: int) -> str:
    import zeroshard

    model = torch.nn.Linear(1, 1)
    engine, *_ = zeroshard.initialize(model=model, config={"train_micro_batch_size_per_gpu": 2,
                                                           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    try:
        engine.deepspeed_io(Stream())
    except ValueError as e:
        return str(e)
    return "every rank got the whole stream"


def test_deepspeed_io_refuses_an_iterable_dataset_it_cannot_shard() -> None:
    for message in run_distributed(iterable_worker, 2):
        assert "Stream is an IterableDataset, which cannot be sharded among the 2 ranks" in message

