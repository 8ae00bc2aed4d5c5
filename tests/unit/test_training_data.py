"""``initialize(training_data=...)`` refuses what it cannot shard among ranks, naming the argument
(one process). A DataLoader passed there was accepted and failed at the first batch with "'DataLoader'
object is not subscriptable"; DeepSpeed refuses it at initialize."""

from __future__ import annotations

import pytest
import torch

import zeroshard
from zeroshard.errors import ConfigError


class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(torch.arange(10.0).unsqueeze(1))

    def __len__(self) -> int:
        return 10


@pytest.mark.parametrize("data,match", [
    (torch.utils.data.DataLoader(torch.arange(10.0).unsqueeze(1)), "must be a dataset .* got a DataLoader"),
    (Stream(), "IterableDataset"),
    (iter(range(10)), "must be a dataset"),
])
def test_unshardable_training_data_is_refused(data, match: str, process_group: None) -> None:
    model = torch.nn.Linear(1, 1)
    with pytest.raises(ConfigError, match=match) as info:
        zeroshard.initialize(model=model, training_data=data, config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert info.value.key == "training_data"


def test_a_list_of_samples_is_a_dataset(process_group: None) -> None:
    model = torch.nn.Linear(1, 1)
    engine, _, loader, _ = zeroshard.initialize(model=model, training_data=[torch.tensor([float(i)]) for i in range(6)],
                                                config={"train_micro_batch_size_per_gpu": 2,
                                                        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert sorted(int(v) for batch in loader for v in batch.flatten()) == list(range(6))
    # DeepSpeed's loader attributes that scripts read; zeroshard loads in the training process.
    assert (loader.len, loader.num_local_io_workers, loader.dataloader_drop_last) == (3, 0, False)
    engine.destroy()
