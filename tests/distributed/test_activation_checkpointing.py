"""Activation checkpointing under the engine, at ZeRO stages 0–3, against plain PyTorch without it.

One spawned run (2 ranks) loops over stages × modes: ``zeroshard.checkpointing.checkpoint`` with
the config block applied by ``initialize``, with ``cpu_checkpointing``, with ``partition_activations``
over a model-parallel group, and Hugging Face's pattern (``gradient_checkpointing_enable`` with
torch's own checkpoint, reentrant and not). The model has dropout, so parity also shows that the
recomputed forward draws the forward's masks. Every rank trains on the same batch with the same
seed: that is what a model-parallel group sees (the partitioned inputs must be equal across it),
and it makes the single-process reference exact.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_distributed
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import zeroshard
from zeroshard.activations import STATS, unconfigure
from zeroshard.errors import DistributedError

VOCAB, DIM, LAYERS, BATCH, SEQ, STEPS, LR = 32, 16, 3, 4, 8, 2, 1e-2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM), nn.Dropout(0.2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(self.drop(F.gelu(self.up(h))))


class TinyLM(nn.Module):
    """``how``: None (no checkpointing), "ds" (``zeroshard.checkpointing.checkpoint``) or a Hugging
    Face style ``_gradient_checkpointing_func``, set by :meth:`gradient_checkpointing_enable`."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)
        self.gradient_checkpointing = False
        self._gradient_checkpointing_func: Any = None

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """transformers' PreTrainedModel.gradient_checkpointing_enable, reduced to what it does."""
        kwargs = {"use_reentrant": True} if gradient_checkpointing_kwargs is None else gradient_checkpointing_kwargs
        self._gradient_checkpointing_func = functools.partial(torch_checkpoint, **kwargs)
        self.gradient_checkpointing = True

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for block in self.blocks:
            h = self._gradient_checkpointing_func(block.__call__, h) if self.gradient_checkpointing else block(h)
        return self.head(self.norm(h))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return (torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=g))


def build(mode: str | None) -> TinyLM:
    torch.manual_seed(0)
    model = TinyLM()
    if mode in ("ds", "cpu", "partition"):
        model.gradient_checkpointing = True
        model._gradient_checkpointing_func = zeroshard.checkpointing.checkpoint
    elif mode == "hf":
        model.gradient_checkpointing_enable()  # torch's reentrant checkpoint, transformers' default
    elif mode == "hf_nonreentrant":
        model.gradient_checkpointing_enable({"use_reentrant": False})
    return model


def step_seed(step: int) -> None:
    torch.manual_seed(100 + step)  # dropout masks of this step; the same on every rank and in the reference


def reference(device: str = "cpu") -> tuple[list[float], dict[str, torch.Tensor]]:
    model, (x, y) = build(None).to(device), (t.to(device) for t in data())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        step_seed(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x[step]).reshape(-1, VOCAB), y[step].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


class WorldMPU:
    """A model-parallel unit whose model-parallel group is ``group`` (tensor parallelism's view)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.group

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self.group)

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self.group)


def train(stage: int, mode: str, world: int, mp_group: dist.ProcessGroup | None) -> dict[str, Any]:
    block = {"cpu": {"cpu_checkpointing": True}, "partition": {"partition_activations": True}}.get(mode, {})
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                 "stage3_max_live_parameters": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
           **({"activation_checkpointing": block} if block else {})}
    unconfigure()
    if mode == "partition":  # Megatron's order: configure with the mpu and the config, then initialize
        zeroshard.checkpointing.configure(WorldMPU(mp_group), deepspeed_config=cfg)
    engine, optimizer, _, _ = zeroshard.initialize(model=build(mode), config=cfg)
    x, y = (t.to(engine.device) for t in data())
    losses, peaks, host = [], [], []
    for step in range(STEPS):
        step_seed(step)
        STATS.reset()
        logits = engine(x[step])
        host.append(STATS.host_bytes == STATS.live_bytes)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y[step].reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        peaks.append(STATS.peak_bytes)
    with engine.gathered():
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "params": params, "peak_saved_input_bytes": peaks[-1], "on_host": all(host),
            "gathered": STATS.gathered, "configured": zeroshard.checkpointing.is_configured(),
            "zero3_gathers": getattr(getattr(optimizer, "coordinator", None), "gather_count", None)}


def worker(rank: int, world: int) -> dict[str, Any]:
    mp_group = dist.new_group(list(range(world)))
    out: dict[str, Any] = {"reference": reference(), "3/none": train(3, "none", world, mp_group)}
    for stage in range(4):
        for mode in ("ds", "cpu", "partition", "hf", "hf_nonreentrant"):
            out[f"{stage}/{mode}"] = train(stage, mode, world, mp_group)
    # A wrong mpu: ranks with different inputs cannot partition them; every rank raises.
    unconfigure()
    zeroshard.checkpointing.configure(WorldMPU(mp_group), partition_activations=True)
    x = torch.full((4, DIM), float(rank), requires_grad=True)
    try:
        zeroshard.checkpointing.checkpoint(torch.tanh, x)
        out["mismatch"] = "no error"
    except DistributedError as exc:
        out["mismatch"] = str(exc)
    unconfigure()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(worker, 2, timeout=600.0)


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("mode", ["ds", "cpu", "partition", "hf", "hf_nonreentrant"])
def test_parity_with_plain_pytorch(results: list[dict[str, Any]], stage: int, mode: str) -> None:
    ref_losses, ref_params = results[0]["reference"]
    for out in results:
        got = out[f"{stage}/{mode}"]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=0, atol=1e-5)
        for name, p in ref_params.items():
            torch.testing.assert_close(got["params"][name], p, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("stage", range(4))
def test_partition_halves_saved_inputs(results: list[dict[str, Any]], stage: int) -> None:
    for out in results:
        whole, part = out[f"{stage}/ds"], out[f"{stage}/partition"]
        # LAYERS inputs of BATCH*SEQ*DIM fp32 each, kept whole, and half of each on each of 2 ranks.
        assert whole["peak_saved_input_bytes"] == LAYERS * BATCH * SEQ * DIM * 4
        assert part["peak_saved_input_bytes"] == whole["peak_saved_input_bytes"] // 2
        assert part["gathered"] == LAYERS  # one all-gather per region at recomputation (last step)
        assert whole["gathered"] == 0


@pytest.mark.parametrize("stage", range(4))
def test_cpu_checkpointing_keeps_inputs_on_host(results: list[dict[str, Any]], stage: int) -> None:
    for out in results:
        got = out[f"{stage}/cpu"]
        assert got["on_host"] and got["peak_saved_input_bytes"] > 0 and got["configured"]
    assert not results[0][f"{stage}/hf"]["configured"]  # no block in the config, no configure(): as DeepSpeed


def test_zero3_gathers_again_for_the_recomputation(results: list[dict[str, Any]]) -> None:
    # Parameters released after forward (stage3_max_live_parameters 0) are gathered by the
    # recomputed forward's pre-hooks, inside backward: one more gather per block and step.
    for out in results:
        plain = out["3/none"]["zero3_gathers"]
        for mode in ("ds", "partition", "hf", "hf_nonreentrant"):
            assert out[f"3/{mode}"]["zero3_gathers"] >= plain + STEPS * LAYERS, mode


def test_partition_rejects_inputs_that_differ_across_the_group(results: list[dict[str, Any]]) -> None:
    for out in results:
        assert "differs between model-parallel ranks" in out["mismatch"]
