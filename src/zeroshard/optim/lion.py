"""The Lion optimizer in plain torch, matching DeepSpeed's ``FusedLion`` update.

torch has no Lion, and DeepSpeed's ``FusedLion`` / ``DeepSpeedCPULion`` are compiled ops, which
zeroshard never builds. This is the same update written with ordinary tensor ops (Chen et al.,
*Symbolic Discovery of Optimization Algorithms*, https://arxiv.org/abs/2302.06675)::

    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * weight_decay) - lr * sign(c)
    m = beta2 * m + (1 - beta2) * g

with DeepSpeed's ``FusedLion`` convention that ``sign(0)`` is ``-1`` (its kernel writes
``c > 0 ? -lr : lr``), so an element is always moved by exactly ``lr``. The state is named as
DeepSpeed names it (``exp_avg``, ``step``) so that optimizer state dicts line up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from zeroshard.optim import _validate as check


class Lion(torch.optim.Optimizer):
    """Lion (EvoLved Sign Momentum), elementwise, so it is exact on ZeRO flat shards.

    Args:
        params: tensors or param-group dicts, as for any torch optimizer.
        lr: learning rate (DeepSpeed default ``1e-3``).
        betas: ``(beta1, beta2)``: interpolation for the update direction and decay of the momentum
            (DeepSpeed default ``(0.9, 0.999)``).
        weight_decay: decoupled weight decay (DeepSpeed default ``0``).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
    ) -> None:
        check.non_negative(lr, "optimizer.params.lr")
        check.betas(betas, "optimizer.params.betas")
        check.non_negative(weight_decay, "optimizer.params.weight_decay")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Apply one Lion update to every parameter that has a gradient.

        Args:
            closure: optional callable that re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr = float(group["lr"])
            beta1, beta2 = group["betas"]
            decay = 1.0 - lr * float(group["weight_decay"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                grad, exp_avg = p.grad, state["exp_avg"]
                direction = exp_avg.mul(beta1).add_(grad, alpha=1.0 - beta1)
                # +1 where c <= 0, -1 where c > 0: FusedLion's `c > 0 ? -lr : lr`.
                sign = direction.gt_(0).mul_(-2.0).add_(1.0)
                if decay != 1.0:
                    p.mul_(decay)
                p.add_(sign, alpha=lr)
                exp_avg.mul_(beta2).add_(grad, alpha=1.0 - beta2)
        return loss
