"""ZeRO-3, a module every rank runs but whose output one rank's loss leaves out (``if mask.any():
loss = loss + aux_loss``): backward reaches it, and gathers it again, on the other ranks only.

That is a collective some ranks skip, as in DeepSpeed; in the guarded first steps it is a
``DistributedError`` that names the module and says what to do: keep the output in every rank's
loss with a zero term, which then trains exactly as plain PyTorch without the term.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import run_distributed
from tests.models import gathered_weights, relative_distance

STEPS, WORLD, GA, MB, LR = 3, 2, 3, 3, 1e-2


class AuxNet(nn.Module):
    """``aux`` runs first in forward, so with no live budget it is released before backward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(11, 37)
        self.aux = nn.Linear(37, 5)
        self.hidden = nn.Linear(37, 29)
        self.out = nn.Linear(29, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor, use_aux: bool, zero_term: bool) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        a = self.aux(h)
        loss = F.cross_entropy(self.out(torch.tanh(self.hidden(h))), y)
        if use_aux:
            return loss + 0.5 * F.cross_entropy(a, y)
        return loss + 0 * a.sum() if zero_term else loss


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, GA, WORLD, MB, 11, generator=g), torch.randint(0, 5, (STEPS, GA, WORLD, MB), generator=g)


def _uses_aux(rank: int, micro: int) -> bool:
    return not (rank == 1 and micro == 0)  # e.g. no labels for the auxiliary head in that batch


def worker(rank: int, world: int, zero_term: bool) -> Any:
    import zeroshard
    from zeroshard.errors import DistributedError

    x, y = _data()
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GA, "gradient_clipping": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_max_live_parameters": 0}}
    engine, *_ = zeroshard.initialize(model=AuxNet(), config=cfg)
    try:
        for s in range(STEPS):
            for m in range(GA):
                engine.backward(engine(x[s, m, rank], y[s, m, rank], _uses_aux(rank, m), zero_term))
                engine.step()
    except DistributedError as e:
        return str(e)
    return gathered_weights(engine)


def _reference() -> dict[str, torch.Tensor]:
    x, y = _data()
    torch.manual_seed(0)
    model = AuxNet()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for s in range(STEPS):
        opt.zero_grad()
        for m in range(GA):
            for r in range(WORLD):
                (model(x[s, m, r], y[s, m, r], _uses_aux(r, m), False) / (GA * WORLD)).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_an_output_left_out_of_one_ranks_loss_is_an_error_that_says_what_to_do() -> None:
    for message in run_distributed(worker, WORLD, False):
        assert isinstance(message, str), "trained although one rank's backward gathered 'aux' alone"
        assert "aux" in message and "0 * aux_out.sum()" in message, message


def test_the_zero_term_trains_as_plain_pytorch() -> None:
    ref = _reference()
    for got in run_distributed(worker, WORLD, True):
        assert not isinstance(got, str), got
        assert relative_distance(got, ref) <= 1e-5
