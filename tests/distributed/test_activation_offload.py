"""Activation offload (DeepSpeed's ``CheckpointHiddenStatesOffload``) under the engine, 2 ranks: training
with the checkpointed blocks' inputs offloaded equals training without the offload, bit for bit.

The model marks each block's input for the innermost active manager (``current_offload()``, as the
Hugging Face marker does for ``GradientCheckpointingLayer``) and checkpoints the block with torch's
non-reentrant checkpoint or with ``zeroshard.checkpointing.checkpoint``. Each micro-step's forward
and backward run inside the manager. On a CPU run DeepSpeed's default skips the marked tensors
(they are in host memory already), so the offloading runs also use ``offload_cpu_tensors=True``,
which copies them out to host buffers and back as a GPU run would: the values the recomputation
sees come from those buffers. Ranks train on different data (plain data parallelism), with dropout
and two micro-steps per step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import zeroshard
from zeroshard.activations import HiddenStatesOffload, current_offload, unconfigure
from zeroshard.deepspeed.activation_offload import CheckpointHiddenStatesOffload

VOCAB, DIM, LAYERS, BATCH, SEQ, STEPS, ACC, LR = 32, 16, 4, 2, 8, 3, 2, 1e-2
STAGES = (2, 3)
#: name -> (how the blocks are checkpointed, the manager's class and options, or None: no offload)
MODES: dict[str, tuple[str, Any]] = {
    "torch": ("torch", None),
    "torch+offload": ("torch", (HiddenStatesOffload, {"offload_cpu_tensors": True, "keep_last_count": 1})),
    "torch+offload_keep0": ("torch", (HiddenStatesOffload, {"offload_cpu_tensors": True, "keep_last_count": 0,
                                                            "min_offload_bytes": 0})),
    "torch+ds_default": ("torch", (CheckpointHiddenStatesOffload, {})),  # DeepSpeed's defaults: skipped on CPU
    "zeroshard": ("zeroshard", None),
    "zeroshard+offload": ("zeroshard", (CheckpointHiddenStatesOffload, {"offload_cpu_tensors": True,
                                                                        "keep_last_count": 1})),
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.up, self.down = nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.drop = nn.Dropout(0.2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(self.down(F.gelu(self.up(self.ln(h)))))


class TinyLM(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for block in self.blocks:
            offload = current_offload()
            if offload is not None:
                offload.mark(h)
            if self.how == "torch":
                h = torch_checkpoint(block, h, use_reentrant=False)
            else:
                h = zeroshard.checkpointing.checkpoint(block, h)
        return self.head(self.norm(h))


def train(stage: int, mode: str, rank: int) -> dict[str, Any]:
    how, spec = MODES[mode]
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": ACC, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}}
    unconfigure()
    torch.manual_seed(0)
    engine, _, _, _ = zeroshard.initialize(model=TinyLM(how), config=cfg)
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own data
    x = torch.randint(0, VOCAB, (STEPS * ACC, BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (STEPS * ACC, BATCH, SEQ), generator=g)
    manager = spec[0](**spec[1]) if spec is not None else None
    losses, stats = [], []
    for i in range(STEPS * ACC):
        torch.manual_seed(1000 * rank + i)  # dropout masks: the same in every mode
        with manager if manager is not None else torch.enable_grad():
            loss = F.cross_entropy(engine(x[i]).reshape(-1, VOCAB), y[i].reshape(-1))
            held = manager.stats.host_bytes if manager is not None else 0
            engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if manager is not None:
            stats.append({**vars(manager.stats), "host_bytes_after_forward": held})
    with engine.gathered():
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "params": params, "stats": stats}


def worker(rank: int, world: int) -> dict[str, Any]:
    return {f"{stage}/{mode}": train(stage, mode, rank) for stage in STAGES for mode in MODES}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(worker, 2, timeout=600.0)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("mode", [m for m in MODES if "+" in m])
def test_offload_trains_as_without(results: list[dict[str, Any]], stage: int, mode: str) -> None:
    baseline = mode.split("+")[0]
    for out in results:
        want, got = out[f"{stage}/{baseline}"], out[f"{stage}/{mode}"]
        assert got["losses"] == want["losses"]
        for name, p in want["params"].items():
            assert torch.equal(got["params"][name], p), name  # bit-identical: the same values come back
    # and training moved: the parameters differ from the first step's
    assert results[0][f"{stage}/{baseline}"]["losses"][0] != results[0][f"{stage}/{baseline}"]["losses"][-1]


@pytest.mark.parametrize("stage", STAGES)
def test_offload_moves_and_frees_the_marked_inputs(results: list[dict[str, Any]], stage: int) -> None:
    hidden = BATCH * SEQ * DIM * 4  # one block input, fp32
    for out in results:
        for mode, keep in (("torch+offload", 1), ("torch+offload_keep0", 0), ("zeroshard+offload", 1)):
            for s in out[f"{stage}/{mode}"]["stats"]:  # one micro-step each
                assert s["marked_tensors"] == LAYERS and s["skipped_marked_tensors"] == 0
                assert s["offloaded_tensors"] == s["restored_tensors"] == LAYERS - keep
                assert s["kept_last_tensors"] == keep
                assert s["offloaded_bytes"] == s["restored_bytes"] == (LAYERS - keep) * hidden
                assert s["host_bytes_after_forward"] == (LAYERS - keep) * hidden  # held in host buffers
                assert s["host_bytes"] == 0  # backward freed them all
        for s in out[f"{stage}/torch+ds_default"]["stats"]:  # DeepSpeed's CPU semantics: nothing to move
            assert s["marked_tensors"] == LAYERS and s["offloaded_tensors"] == 0
            assert s["skipped_marked_tensors"] == LAYERS and s["host_bytes_after_forward"] == 0
