"""A small LoRA-style model for the frozen-parameter tests: frozen base layers, trainable
low-rank adapters, a norm and a bias. Sizes are odd so that no parameter divides evenly between
ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from models import relative_distance
from torch import nn

import zeroshard

D, RANK, OUT = 67, 5, 11


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update ``B @ A``."""

    def __init__(self, fan_in: int, fan_out: int) -> None:
        super().__init__()
        self.base = nn.Linear(fan_in, fan_out)
        self.A = nn.Parameter(torch.randn(RANK, fan_in) * 0.1)
        self.B = nn.Parameter(torch.randn(fan_out, RANK) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.A), self.B)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(D, D)  # frozen, and the first module: nothing flows back past it
        self.l1 = LoRALinear(D, 3 * D)
        self.norm = nn.LayerNorm(3 * D)
        self.l2 = LoRALinear(3 * D, D)
        self.head = nn.Linear(D, OUT)  # weight frozen, bias trained: one unit, half frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.emb(x))
        g = F.gelu(self.norm(self.l1(h)))
        return self.head(h + self.l2(g))


def trains(name: str) -> bool:
    return name.endswith((".A", ".B")) or name.startswith("norm.") or name == "head.bias"


def build(zero_init: str | None = None) -> Net:
    torch.manual_seed(0)
    if zero_init is None:
        m = Net()
    else:
        with zeroshard.zero.Init(remote_device=None if zero_init == "device" else zero_init):
            m = Net()
    for n, p in m.named_parameters():
        p.requires_grad_(trains(n))
    return m


def check_lora(w: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float, what: str = "") -> float:
    """Assert that ``w`` has the frozen weights of :func:`build` exactly and the trained ones within
    ``tol`` of ``ref`` (relative distance, returned); ``what`` prefixes the messages."""
    initial = {n: p.detach() for n, p in build().named_parameters()}
    assert set(w) == set(ref), f"{what}parameter names differ"
    for n in ref:
        if not trains(n):
            assert torch.equal(w[n].cpu(), initial[n]), f"{what}frozen {n} changed"
    rel = relative_distance(w, ref, [n for n in ref if trains(n)])
    assert rel <= tol, f"{what}‖w − w_ref‖/‖w_ref‖ = {rel:.2e}"
    return rel


def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples of inputs and labels."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, D, generator=g), torch.randint(0, OUT, (n,), generator=g)




class Adapted(nn.Module):
    """A frozen bias-free linear layer (as in Llama) plus a trainable low-rank update, for the
    memory test and benchmark of a large frozen base."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(width, width, bias=False)
        self.lora_a = nn.Linear(width, rank, bias=False)
        self.lora_b = nn.Linear(rank, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + self.lora_b(self.lora_a(x)))


def adapted_stack(layers: int, width: int, rank: int = 8) -> nn.Module:
    """``layers`` :class:`Adapted` layers, the bases frozen and the adapters trainable."""
    model = nn.Sequential(*(Adapted(width, rank) for _ in range(layers)))
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    return model
