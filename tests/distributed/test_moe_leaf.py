"""ZeRO-3 leaf modules for mixture-of-experts blocks that run only the experts their router picked.

Such a block (Hugging Face's MoE models before transformers 5 fused their experts, SwitchTransformers
and NLLB-MoE still, custom and remote-code MoEs) runs different expert modules on ranks whose tokens
route differently, so ZeRO-3's per-module gathers cannot be matched across ranks. Marked a leaf, the
block is gathered whole on every rank. DeepSpeed 0.19 reads ``zero_optimization.leaf_module``
{classes, names, name_suffixes} with Mixtral's, Qwen2-MoE's and Qwen3-MoE's blocks as default classes;
zeroshard refused the key and marked nothing by default. Here, 2 ranks whose tokens go to disjoint
experts: without a leaf, a ``DistributedError`` that names the remedy; with one (by class name, by
name suffix, through ``zeroshard.utils.set_z3_leaf_modules``), plain PyTorch's parameters (fp32, 1e-5).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from models import gathered_weights, micro_batch, reference_by_micro_batch, relative_distance
from torch import nn

import zeroshard
from zeroshard.errors import DistributedError

STEPS, GA, GLOBAL_BATCH, SEQ, VOCAB, WORLD, LR, CLIP = 3, 2, 8, 5, 32, 2, 1e-2, 1.0
EXPERTS, D = 4, 12
TOL = 1e-5


class LoopMoE(nn.Module):
    """Experts picked by token id (the first half of the vocabulary goes to experts 0-1), each
    scaled by a learned gate; an expert no token picked does not run."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, EXPERTS)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(D, 2 * D + 1), nn.Tanh(), nn.Linear(2 * D + 1, D))
                                     for _ in range(EXPERTS))

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        route = ids * EXPERTS // VOCAB
        gates = torch.sigmoid(self.gate(h))
        out = torch.zeros_like(h)
        for e in route.unique().tolist():
            idx = (route == e).nonzero().squeeze(1)
            out = out.index_add(0, idx, self.experts[e](h[idx]) * gates[idx, e : e + 1])
        return out


class MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.block = nn.ModuleDict({"moe": LoopMoE()})
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        h = self.embed(flat)
        h = h + self.block["moe"](h, flat)
        return F.cross_entropy(self.head(h), labels.reshape(-1))


def make_moe() -> MoENet:
    torch.manual_seed(0)
    return MoENet()


def make_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's samples draw from the first half of the vocabulary, rank 1's from the second."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB // 2, (STEPS, GLOBAL_BATCH, SEQ), generator=g)
    micro_bs = GLOBAL_BATCH // (GA * WORLD)
    rank_of = (torch.arange(GLOBAL_BATCH) % (WORLD * micro_bs)) // micro_bs
    ids += (VOCAB // 2) * rank_of.view(1, -1, 1)
    return ids, torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, SEQ), generator=g)


def worker(rank: int, world: int, leaf: str) -> dict:
    x, y = make_tokens()
    micro_bs = GLOBAL_BATCH // (GA * world)
    zero: dict = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if leaf == "classes":
        zero["leaf_module"] = {"classes": ["LoopMoE"]}
    elif leaf == "suffixes":
        zero["leaf_module"] = {"name_suffixes": "block.moe"}  # one string, read as a list of one
    model = make_moe()
    if leaf == "api":
        assert zeroshard.utils.set_z3_leaf_modules(model, [LoopMoE]) == [model.block["moe"]]
    cfg = {"train_micro_batch_size_per_gpu": micro_bs, "gradient_accumulation_steps": GA, "gradient_clipping": CLIP,
           "zero_optimization": zero, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}}
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    try:
        for step in range(STEPS):
            for m in range(GA):
                xb, yb = (micro_batch(t, step, m, rank, world, micro_bs) for t in (x, y))
                engine.backward(engine(xb, yb))
                engine.step()
    except DistributedError as e:
        engine.destroy()
        return {"error": str(e)}
    out = gathered_weights(engine)
    out["leaves"] = [n for n, m in engine.module.named_modules() if zeroshard.utils.z3_leaf_module(m)]
    engine.destroy()
    return out


def test_experts_routed_differently_per_rank_without_a_leaf_name_the_remedy() -> None:
    for result in run_distributed(worker, WORLD, "none"):
        assert "error" in result, "ranks ran different experts and nothing said so"
        assert "set_z3_leaf_modules" in result["error"] and "leaf_module" in result["error"], result["error"]


@pytest.mark.parametrize("leaf", ["classes", "suffixes", "api"])
def test_a_leaf_moe_block_trains_as_plain_pytorch(leaf: str) -> None:
    ref = reference_by_micro_batch(lambda model, x, y: model(x, y), STEPS, GA, GLOBAL_BATCH, WORLD, LR, CLIP,
                                   model_fn=make_moe, data=make_tokens())
    for rank, got in enumerate(run_distributed(worker, WORLD, leaf)):
        assert "error" not in got, got.get("error")
        assert got.pop("leaves") == ["block.moe"]
        dist = relative_distance(got, ref)
        assert dist <= TOL, f"leaf by {leaf}, rank {rank}: {dist:.2e} from plain PyTorch"
