"""``GatheredParameters(params, modifier_rank=0)`` on a model built under ``zero.Init``, before
``initialize``: how transformers loads pretrained weights into a ZeRO-3 model. The block sees
whole parameters, rank 0's writes reach every rank's chunk, other ranks' writes and a block
without ``modifier_rank`` change nothing, and ``initialize`` trains from the written values."""

from __future__ import annotations

import torch
from harness import run_distributed
from torch import nn

import zeroshard
from zeroshard.zero import GatheredParameters, Init


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))


def _pretrained() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {k: torch.randn(v.shape, generator=g) for k, v in _model().state_dict().items()}


def worker(rank: int, world: int, stage: int) -> dict:
    torch.manual_seed(rank)  # different random init per rank: only rank 0's writes may survive
    with Init():
        model = _model()
    shapes_inside = []
    with GatheredParameters(list(model.parameters())):  # no modifier: writes are discarded
        for p in model.parameters():
            p.data.fill_(123.0)
    weights = _pretrained()
    with GatheredParameters(list(model.parameters()), modifier_rank=0):
        for name, p in model.named_parameters():
            shapes_inside.append(tuple(p.shape))
            if rank == 0:
                p.data.copy_(weights[name])
            else:
                p.data.fill_(-1.0)
    empty_after = all(p.numel() == 0 for p in model.parameters())
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.randn(2, 7, generator=torch.Generator().manual_seed(3))
    with GatheredParameters(list(model.parameters())):
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = engine(x).detach()
    return {"shapes": shapes_inside, "empty_after": empty_after, "got": got, "out": out}


def test_modifier_rank_writes_reach_every_rank_before_initialize() -> None:
    weights = _pretrained()
    reference = _model()
    reference.load_state_dict(weights)
    x = torch.randn(2, 7, generator=torch.Generator().manual_seed(3))
    expected_out = reference(x).detach()
    for stage in (3, 2):
        for rank, r in enumerate(run_distributed(worker, 2, stage)):
            assert r["shapes"] == [tuple(v.shape) for v in weights.values()], (stage, rank)
            assert r["empty_after"], (stage, rank)  # back to chunks after the block
            for name, value in weights.items():
                assert torch.equal(r["got"][name], value), (stage, rank, name)
            torch.testing.assert_close(r["out"], expected_out, rtol=1e-6, atol=1e-6)
