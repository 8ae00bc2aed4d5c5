"""Small models and data for tests: parameter sizes that no world size of 2, 3 or 4 divides."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


class ToyNet(nn.Module):
    """An MLP with a LayerNorm; every parameter's element count is odd (407, 37, 1073, 29, 145, 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(11, 37)
        self.norm = nn.LayerNorm(37)
        self.hidden = nn.Linear(37, 29)
        self.out = nn.Linear(29, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.norm(self.embed(x)))
        logits = self.out(torch.tanh(self.hidden(h)))
        return torch.nn.functional.cross_entropy(logits.float(), y)


def make_model(seed: int = 0) -> ToyNet:
    """A freshly initialized :class:`ToyNet` (same values for the same seed)."""
    torch.manual_seed(seed)
    return ToyNet()


def make_data(steps: int, global_batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``steps`` global batches of inputs ``[steps, global_batch, 11]`` and labels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, global_batch, 11, generator=g) * 2
    y = torch.randint(0, 5, (steps, global_batch), generator=g)
    return x, y


def micro_batch(x: torch.Tensor, step: int, micro: int, rank: int, world: int, micro_bs: int) -> torch.Tensor:
    """Rank ``rank``'s slice for micro-step ``micro`` of ``step``: the global batch is split by
    micro-step first, then by rank, so every sample is used exactly once per step."""
    per_micro = world * micro_bs
    start = micro * per_micro + rank * micro_bs
    return x[step, start : start + micro_bs]


def train_reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float, clip: float,
                    skip_steps: frozenset[int] = frozenset()) -> nn.Module:
    """Plain single-process PyTorch: AdamW on the whole global batch, global-norm clipping."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for step in range(x.shape[0]):
        if step in skip_steps:
            continue
        opt.zero_grad()
        loss = model(x[step], y[step])
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model


def reference_by_micro_batch(loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor], steps: int,
                             ga: int, global_batch: int, world: int, lr: float, clip: float,
                             model_fn: Callable[[], nn.Module] | None = None,
                             data: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Plain PyTorch for a loop that computes each micro-batch's loss its own way (``loss(model, x, y)``):
    AdamW over ``model_fn()`` (:func:`make_model` ``(0)`` by default), each rank's micro-batch of
    ``data`` (:func:`make_data` ``(steps, global_batch)`` by default) in turn, the loss averaged over the
    window and the ranks as the engine does, global-norm clipping."""
    model = model_fn() if model_fn is not None else make_model(0)
    x, y = data if data is not None else make_data(steps, global_batch)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    micro_bs = global_batch // (ga * world)
    for step in range(steps):
        opt.zero_grad()
        for m in range(ga):
            for r in range(world):
                xb, yb = (micro_batch(t, step, m, r, world, micro_bs) for t in (x, y))
                (loss(model, xb, yb) / (ga * world)).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_reference_mixed(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float, clip: float,
                          dtype: torch.dtype, skip_steps: frozenset[int] = frozenset()) -> nn.Module:
    """Plain single-process mixed precision, the textbook recipe: a ``dtype`` model computes
    forward and backward, fp32 master weights take the AdamW step (no loss scaling: the batch is
    small and its gradients are far from fp16's underflow range)."""
    masters = [p.detach().clone().float().requires_grad_(True) for p in model.parameters()]
    model.to(dtype)
    opt = torch.optim.AdamW(masters, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for step in range(x.shape[0]):
        if step in skip_steps:
            continue
        model.zero_grad(set_to_none=True)
        loss = model(x[step].to(dtype), y[step])
        loss.backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(masters, clip)
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
    return model


def gathered_weights(engine: Any) -> dict[str, torch.Tensor]:
    """The module's parameters, whole (gathered at ZeRO-3: a collective), as fp32 copies."""
    with engine.gathered():
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def relative_distance(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                      names: Iterable[str] | None = None) -> float:
    """‖got − ref‖ / ‖ref‖ over the tensors ``names`` (every key of ``ref`` by default), in fp32."""
    keys = list(ref) if names is None else list(names)
    a, b = (torch.cat([d[n].float().reshape(-1) for n in keys]) for d in (got, ref))
    return ((a - b).norm() / b.norm()).item()
