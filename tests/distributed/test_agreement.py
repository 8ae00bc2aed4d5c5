"""Ranks that disagree fail with an error naming the ranks and what differs, instead of pairing
collectives that were never meant to meet (or hanging): a different config or model, a skipped
backward, and under ZeRO-3 a different module on one rank (of the same size, so its all-gathers would
silently exchange the wrong parameters)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from harness import run_distributed
from torch import nn

import zeroshard
from zeroshard.errors import DistributedError


class Twins(nn.Module):
    """Two blocks of the same size: gathering one where a peer gathers the other would "work"."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.a, self.b, self.out = nn.Linear(7, 9), nn.Linear(9, 9), nn.Linear(9, 9), nn.Linear(9, 3)
        self.c = nn.Linear(9, 9, bias=False)  # another size: a gather of it beside one of a aborts gloo

    def forward(self, x: torch.Tensor, use_b: bool, use_c: bool = False) -> torch.Tensor:
        branch = self.c if use_c else self.b if use_b else self.a
        return self.out(torch.tanh(branch(torch.tanh(self.inp(x)))))


def config(stage: int, lr: float = 1e-2, prefetch: int = 0) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  "stage3_prefetch_bucket_size": prefetch},
            "optimizer": {"type": "AdamW", "params": {"lr": lr}}, "collective_timeout": 20}


def diverging_worker(rank: int, world: int, stage: int, kind: str, verify_gathers: str = "") -> str:
    os.environ["ZEROSHARD_VERIFY_GATHERS"] = verify_gathers  # "": the default (on with gloo)
    torch.manual_seed(0)
    model = Twins()
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config(stage))
    try:
        for step in range(3):
            for micro in range(2):
                x, y = torch.randn(2, 7), torch.randn(2, 3)
                off_path = rank == 1 and step == 1 and micro == 0
                loss = F.mse_loss(engine(x, use_b=off_path and kind == "module"), y)
                if not (off_path and kind == "backward"):
                    engine.backward(loss)
                engine.step()
    except DistributedError as e:
        return str(e)
    return "no error"


def other_size_worker(rank: int, world: int) -> str:
    """Under ZeRO-3 with prefetching, rank 1 runs a module of another size in one forward: the
    all-gathers would differ in size (gloo aborts the process), so the gather guard must name it.
    At step 2 only when every gather is guarded (by default the first two steps are)."""
    os.environ["ZEROSHARD_VERIFY_GATHERS"] = "1"
    torch.manual_seed(0)
    model = Twins()
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(3, prefetch=10_000))
    try:
        for step in range(3):
            for _ in range(2):
                x, y = torch.randn(2, 7), torch.randn(2, 3)
                engine.backward(F.mse_loss(engine(x, use_b=False, use_c=rank == 1 and step == 2), y))
                engine.step()
    except DistributedError as e:
        return str(e)
    return "no error"


def extra_micro_step_worker(rank: int, world: int, stage: int, tmp: str) -> str:
    """Rank 0's data loader has one batch more: it runs an extra micro-step before the save.

    Under ZeRO-3 its extra forward gathers while rank 1 checks in for the save: past the steps
    guarded by default that pairs collectives of different sizes (gloo aborts), so every gather
    is guarded here (``ZEROSHARD_VERIFY_GATHERS=1``, the README's advice for such a divergence)."""
    os.environ["ZEROSHARD_VERIFY_GATHERS"] = "1" if stage == 3 else ""
    torch.manual_seed(0)
    model = Twins()
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config(stage))
    try:
        for _ in range(2 * 2 + (rank == 0)):
            x, y = torch.randn(2, 7), torch.randn(2, 3)
            engine.backward(F.mse_loss(engine(x, use_b=False), y))
            engine.step()
        engine.save_checkpoint(tmp)
    except DistributedError as e:
        return str(e)
    return "no error"


def config_worker(rank: int, world: int) -> str:
    model = nn.Linear(3, 3)
    try:
        zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config(2, 1e-2 * (1 + rank)))
    except DistributedError as e:
        return str(e)
    return "no error"


def save_dir_worker(rank: int, world: int, tmp: str) -> str:
    model = nn.Linear(3, 3)
    engine, *_ = zeroshard.initialize(model=model, config=config(2))
    try:
        engine.save_checkpoint(f"{tmp}/rank{rank}")  # a node-local path per rank
    except DistributedError as e:
        return str(e)
    return "no error"


def test_a_checkpoint_directory_per_rank(tmp_path) -> None:
    for message in run_distributed(save_dir_worker, 2, str(tmp_path)):
        assert "save_checkpoint tag and directory differ" in message and "same directory" in message, message
    assert not list(tmp_path.rglob("*.safetensors")), "nothing is written"


def test_different_configs() -> None:
    for message in run_distributed(config_worker, 2):
        assert "config entries differ" in message and "optimizer.params.lr" in message, message


def test_a_skipped_backward_at_every_stage() -> None:
    for stage in (0, 1):  # gradients are reduced at the window's last micro-step: checked there
        for message in run_distributed(diverging_worker, 2, stage, "backward"):
            assert "ranks disagree at micro-step 2 of 2 of optimizer step 1" in message, (stage, message)
            assert "backward passes in the window: rank 0: 1, rank 1: 0" in message, (stage, message)
    for stage in (2, 3):  # reduced every micro-step: checked before each backward
        for message in run_distributed(diverging_worker, 2, stage, "backward"):
            assert "micro-step of the window: rank 0: 0, rank 1: 1" in message, (stage, message)


def test_another_module_under_zero3() -> None:
    for message in run_distributed(diverging_worker, 2, 3, "module"):  # the gather guard (default with gloo)
        assert "ranks disagree on the next ZeRO-3 all-gather" in message, message
        assert "rank 1: all-gather of ZeRO-3 unit 'b.weight' (90 elements) in the forward" in message, message
    # Without it (the default with NCCL), the check before the backward finds where the sequences part.
    for message in run_distributed(diverging_worker, 2, 3, "module", "0"):
        assert "ZeRO-3 gather sequence" in message, message
        assert "rank 0 gathered 'a.weight', rank 1 gathered 'b.weight'" in message, message


def test_a_module_of_another_size_under_zero3_with_prefetch() -> None:
    for message in run_distributed(other_size_worker, 2):
        # Rank 0 meets it at its next gather or at its backward's check, whichever comes first.
        assert "ranks disagree" in message, message
        assert "rank 1: all-gather of ZeRO-3 unit 'c.weight' (81 elements) in the forward of optimizer step 2" \
            in message, message


def test_an_extra_micro_step_on_one_rank(tmp_path) -> None:
    for stage in (0, 1, 2, 3):
        for message in run_distributed(extra_micro_step_worker, 2, stage, str(tmp_path / f"s{stage}")):
            assert "ranks disagree" in message, (stage, message)
            # stages 0-1: both ranks reach the save's check; 2: rank 0's backward check meets rank 1's save;
            # 3: rank 0's first gather of the extra forward does
            assert "rank 1: save_checkpoint at micro-step 1 " in message or \
                "micro-step of the window: rank 0: 1, rank 1: 0" in message, (stage, message)
        assert not (tmp_path / f"s{stage}" / "latest").exists(), stage  # nothing was saved


def different_model_worker(rank: int, world: int, stage: int, kind: str) -> str:
    """Rank 1 builds another model: a layer more at the end, or a layer of another width."""
    widths = [5, 6, 4] if kind == "shape" and rank == 1 else [5, 7, 4]
    layers = [nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
    if kind == "extra" and rank == 1:
        layers.append(nn.Linear(4, 4))
    model = nn.Sequential(*layers)
    try:
        zeroshard.initialize(model=model, config=config(stage))
    except DistributedError as e:
        return str(e)
    return "no error"


def test_ranks_that_build_different_models() -> None:
    for stage in (0, 3):
        extra = run_distributed(different_model_worker, 2, stage, "extra")
        for rank, message in enumerate(extra):
            assert "module parameters and buffers differ across ranks at entry 4 (ranks [1]" in message, message
            has = "no entry there: it has 4 in all" if rank == 0 else "'2.weight:(4, 4):torch.float32', 6 entries"
            assert has in message, (stage, rank, message)
        for rank, message in enumerate(run_distributed(different_model_worker, 2, stage, "shape")):
            mine = "0.weight:(7, 5)" if rank == 0 else "0.weight:(6, 5)"
            assert f"at entry 0 (ranks [1] differ from rank 0; this rank has '{mine}" in message, (stage, message)
