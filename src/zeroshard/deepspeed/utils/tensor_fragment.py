"""DeepSpeed's ``safe_get_full_*`` / ``safe_set_full_*`` / ``safe_get_local_*`` parameter accessors.

A trained parameter's fp32 master, gradient and optimizer state live in shards (ZeRO stage 1-3:
rank ``r`` holds elements ``[r·k, (r+1)·k)`` of the flattened parameter, ``k`` the padded chunk; stage
0: everything). The ``full`` getters all-gather the chunks (collective: call on every rank); the
``local`` ones return this rank's chunk as a flat tensor; the setters write this rank's part and,
for the fp32 value, the module's own copy, so no communication is needed. DeepSpeed offers the
``local`` accessors at ZeRO-3 only; here they work at every stage.

Gradients are the averaged, accumulated gradients of the current window, readable after a
backward (stages 0-1: after the backward that ends the window, when they are reduced) and until
``step()``; they are returned unscaled (fp16's loss scale divided out). Parameters the engine does
not train (frozen) give ``None`` from the getters, as in DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from zeroshard.core.comm import collectives as C
from zeroshard.core.partition.layout import full_shape
from zeroshard.core.seam import owner_of, unit_of

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
]


class _Fragment:
    """Where one parameter's chunk lives in its owner (the stage's optimizer)."""

    def __init__(self, param: torch.nn.Parameter, owner: Any) -> None:
        self.param, self.owner = param, owner
        self.bucket, self.i = next((b, i) for b in owner.buckets for i, q in enumerate(b.params) if q is param)
        self.layout = self.bucket.layouts[self.i]
        self.start, self.end = owner.master.ranges[param]
        self.master: torch.nn.Parameter = owner.master.views[param]

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The full tensor from every rank's chunk (collective when sharded)."""
        shape = full_shape(self.param)
        if self.layout.world == 1:
            return local.detach().clone().view(shape)
        k = self.layout.shard_numel
        send = torch.zeros(k, dtype=local.dtype, device=local.device)
        send[: local.numel()].copy_(local.reshape(-1))
        out = torch.empty(self.layout.world * k, dtype=local.dtype, device=local.device)
        C.all_gather(out, send, self.owner.group, async_op=False, what="safe_get_full gather")
        return out[: self.layout.numel].view(shape)

    def mine(self, value: torch.Tensor) -> torch.Tensor:
        """This rank's elements of a full ``value``."""
        if value.numel() != self.layout.numel:
            raise ValueError(f"value has {value.numel()} elements, the parameter {self.layout.numel}")
        return value.detach().reshape(-1)[self.start : self.end]

    # -- gradients ---------------------------------------------------------------------------------
    def grad(self) -> torch.Tensor | None:
        """This rank's gradient chunk in the sync's buffer (scaled), or None before any is reduced."""
        sync = self.owner.sync
        reduced = sync.reduced or (sync.reduces_every_micro_step and sync.received_gradients())
        if not reduced:
            return None
        off = self.bucket.offsets[self.i]
        return self.owner.grad_shard()[self.bucket.index][off : off + (self.end - self.start)]

    def scale(self) -> float:
        return float(self.owner.scaler.scale)


def _fragment(param: torch.nn.Parameter) -> _Fragment | None:
    owner = owner_of(param)
    if owner is None or param not in owner.master.views:
        return None
    return _Fragment(param, owner)


def _require(param: torch.nn.Parameter, what: str) -> _Fragment:
    frag = _fragment(param)
    if frag is None:
        raise ValueError(f"{what}: the parameter is not trained by a zeroshard engine (frozen, or not passed "
                         "to initialize())")
    return frag


def _state(frag: _Fragment, key: str) -> torch.Tensor:
    if not frag.owner.store.has_state(frag.master):
        raise KeyError(f"optimizer state {key!r} does not exist yet: the optimizer creates it at its first step")
    state = frag.owner.store.state(frag.master)  # in memory or read from a swap file
    if key not in state:
        raise KeyError(f"optimizer state {key!r} does not exist for this parameter (keys: {sorted(state)})")
    value: torch.Tensor = state[key]
    return value


def _state_or_none(frag: _Fragment, key: str) -> torch.Tensor | None:
    """The state, or None before the optimizer's first step created any (as DeepSpeed's getters)."""
    if not frag.owner.store.has_state(frag.master):
        return None
    return _state(frag, key)


# -- fp32 parameters ------------------------------------------------------------------------------
def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The full fp32 master value of ``param`` (collective)."""
    frag = _fragment(param)
    return None if frag is None else frag.gather(frag.owner.store.master_values(frag.master))


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's chunk of the fp32 master (flat)."""
    frag = _fragment(param)
    return None if frag is None else frag.owner.store.master_values(frag.master)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set the fp32 master of ``param`` to ``value`` (the full tensor, the same on every rank), and the
    module's copy of it (stage 3: this rank's shard, and the gathered copy if gathered now)."""
    frag = _require(param, "safe_set_full_fp32_param")
    with torch.no_grad():
        frag.owner.store.write_master(frag.master, frag.mine(value))
        if param.numel() == frag.layout.numel:  # whole here (stages 0-2, or a gathered ZeRO-3 unit)
            param.data.copy_(value.detach().view_as(param))
        unit = unit_of(param)
        if unit is not None:  # ZeRO-3: the compute-dtype shard gathers read
            off = unit.bucket.offsets[unit.position(param)]
            unit.write_shard(off, frag.mine(value))


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set this rank's chunk of the fp32 master (flat ``value``); the module sees it after the next step."""
    frag = _require(param, "safe_set_local_fp32_param")
    frag.owner.store.write_master(frag.master, value.detach().reshape(-1))


# -- gradients --------------------------------------------------------------------------------------
def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The full averaged fp32 gradient of ``param`` in this window (collective), None before one exists."""
    frag = _fragment(param)
    local = frag.grad() if frag is not None else None
    if frag is None or local is None:
        return None
    return frag.gather(local.float() / frag.scale())


def safe_get_local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's chunk of the averaged fp32 gradient (flat), None before one exists."""
    frag = _fragment(param)
    local = frag.grad() if frag is not None else None
    return None if frag is None or local is None else local.float() / frag.scale()


def _set_grad(param: torch.nn.Parameter, local_value: torch.Tensor, what: str) -> None:
    frag = _require(param, what)
    local = frag.grad()
    if local is None:
        raise RuntimeError(f"{what}: no gradient to replace yet; call it after backward() (stages 0-1: after the "
                           "backward that ends the accumulation window) and before step()")
    with torch.no_grad():
        local.copy_(local_value.reshape(-1) * frag.scale())


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace the gradient of ``param`` by ``value`` (full, the same on every rank) for the next step."""
    frag = _require(param, "safe_set_full_grad")
    _set_grad(param, frag.mine(value).float(), "safe_set_full_grad")


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace this rank's chunk of the gradient of ``param`` (flat ``value``) for the next step."""
    _set_grad(param, value.detach().float(), "safe_set_local_grad")


def safe_update_full_grad_vectorized(param_list: Iterable[torch.nn.Parameter],
                                     update_func: Callable[[torch.Tensor, torch.nn.Parameter], torch.Tensor]) -> None:
    """Replace the gradient of each parameter by ``update_func(full_gradient, param)`` (collective: call on
    every rank with the same parameters in the same order).

    A parameter a zeroshard engine trains gets its full averaged fp32 gradient, and its return value (full,
    the same on every rank) replaces it for the next step, as :func:`safe_set_full_grad`; a parameter the
    engine does not train is updated in place when it holds a ``.grad``, else skipped (frozen). DeepSpeed
    batches the ZeRO-3 case in one call; here each parameter is gathered in turn, with the same result.
    """
    for param in param_list:
        if _fragment(param) is None:
            if param.grad is not None:
                with torch.no_grad():
                    param.grad.copy_(update_func(param.grad, param))
            continue
        old = safe_get_full_grad(param)
        if old is None:
            raise RuntimeError("safe_update_full_grad_vectorized: no gradient to update yet; call it after "
                               "backward() (stages 0-1: after the backward that ends the accumulation window) and "
                               "before step()")
        safe_set_full_grad(param, update_func(old, param))


# -- optimizer state ---------------------------------------------------------------------------------
def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The full optimizer state ``optim_state_key`` (``exp_avg``...) of ``param`` (collective)."""
    frag = _fragment(param)
    local = None if frag is None else _state_or_none(frag, optim_state_key)
    if frag is None or local is None:
        return None
    return local.detach().clone() if local.numel() != frag.master.numel() else frag.gather(local)


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """This rank's chunk of the optimizer state ``optim_state_key`` (flat)."""
    frag = _fragment(param)
    local = None if frag is None else _state_or_none(frag, optim_state_key)
    return None if local is None else local.detach()


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set the optimizer state ``optim_state_key`` of ``param`` from the full ``value``."""
    frag = _require(param, "safe_set_full_optimizer_state")
    _state(frag, optim_state_key)  # exists, or a KeyError naming the keys
    frag.owner.store.write_state(frag.master, optim_state_key, frag.mine(value))


def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's chunk of the optimizer state ``optim_state_key`` (flat ``value``)."""
    frag = _require(param, "safe_set_local_optimizer_state")
    _state(frag, optim_state_key)
    frag.owner.store.write_state(frag.master, optim_state_key, value.detach().reshape(-1))
