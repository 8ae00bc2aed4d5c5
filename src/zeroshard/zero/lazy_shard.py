"""A full-shape tensor that stores only this rank's chunk: the parameter stand-in of ``zero.Init``.

While a module is built under ``zero.Init`` its parameters are :class:`LazyShardTensor`\\ s. Any
torch operation on one (``normal_``, ``uniform_``, ``copy_``, a read) runs on the *full* values,
materialized by gathering every rank's chunk, and the result stays cached until another parameter
is materialized; then the cached one collapses back to this rank's chunk. So the initialisation
code of a module, and of a parent that re-initialises its children afterwards (Hugging Face
``post_init``), runs unchanged on full tensors with the same random stream as without
``zero.Init``, while at most one full parameter exists at a time.

On collapse the full values are broadcast from rank 0 first, so every rank keeps a chunk of the
same tensor even if ranks were seeded differently (DeepSpeed does the same).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from zeroshard.comm import collectives as C
from zeroshard.partition import ShardLayout

aten = torch.ops.aten


class ShardCore:
    """The storage behind one parameter: this rank's chunk, or the full values while cached."""

    def __init__(self, full: torch.Tensor, session: InitSession) -> None:
        self.shape = full.shape
        self.dtype = full.dtype
        self.layout = ShardLayout(full.numel(), session.world)
        self.session = session
        self.chunk: torch.Tensor | None = None
        self.full: torch.Tensor | None = full
        session.cache(self)

    def materialize(self) -> torch.Tensor:
        """Full values (gathered from every rank's chunk unless cached)."""
        if self.full is None:
            assert self.chunk is not None
            k = self.layout.shard_numel
            padded = torch.zeros(k, dtype=self.dtype, device=self.chunk.device)
            padded[: self.chunk.numel()] = self.chunk
            out = torch.empty(k * self.session.world, dtype=self.dtype, device=self.chunk.device)
            C.all_gather(out, padded, self.session.group, async_op=False)
            self.full = out[: self.layout.numel].view(self.shape).clone()
            self.session.chunk_bytes -= self.chunk.numel() * self.chunk.element_size()
            self.chunk = None
        self.session.cache(self)
        return self.full

    def collapse(self) -> None:
        """Keep only this rank's chunk of rank 0's full values."""
        if self.full is None:
            return
        full = self.full.contiguous()
        C.broadcast(full, src=0, group=self.session.group)
        s, e = self.layout.local_range(self.session.rank)
        self.chunk = full.view(-1)[s:e].clone()
        self.full = None
        self.session.chunk_bytes += self.chunk.numel() * self.chunk.element_size()


class InitSession:
    """State of one ``zero.Init`` context: the group and the one cached full parameter."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.world = C.world_size(group)
        self.rank = C.rank(group)
        self.cached: ShardCore | None = None
        self.chunk_bytes = 0
        #: most bytes of parameter values held at once (chunks + the one full parameter)
        self.peak_bytes = 0

    def cache(self, core: ShardCore) -> None:
        if self.cached is not None and self.cached is not core:
            self.cached.collapse()
        self.cached = core
        full = core.full.numel() * core.full.element_size() if core.full is not None else 0
        self.peak_bytes = max(self.peak_bytes, self.chunk_bytes + full)

    def flush(self) -> None:
        if self.cached is not None:
            self.cached.collapse()
            self.cached = None


class LazyShardTensor(torch.Tensor):
    """Wrapper tensor with a parameter's full shape whose values live in a :class:`ShardCore`."""

    core: ShardCore

    @staticmethod
    def __new__(cls, core: ShardCore, requires_grad: bool = False) -> LazyShardTensor:
        device = core.full.device if core.full is not None else core.chunk.device  # type: ignore[union-attr]
        t = torch.Tensor._make_wrapper_subclass(cls, core.shape, dtype=core.dtype, device=device,
                                                requires_grad=requires_grad)
        t.core = core
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __repr__(self) -> str:  # type: ignore[override]
        return f"LazyShardTensor(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return LazyShardTensor(args[0].core)
        cores: dict[int, ShardCore] = {}

        def unwrap(x: Any) -> Any:
            if isinstance(x, LazyShardTensor):
                full = x.core.materialize()
                cores[id(full)] = x.core
                return full
            return x

        out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs))
        # An in-place op returns its (full) argument: hand back the lazy tensor instead.
        return pytree.tree_map(lambda o: LazyShardTensor(cores[id(o)]) if id(o) in cores else o, out)
