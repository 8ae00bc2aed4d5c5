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

Memory (each rank should grow by its chunks plus one parameter in flight; issue #9 measured
1.5-2.6x the whole model before these):

- A parameter is partitioned as soon as it is registered, so the constructor's full tensor is
  freed before the next parameter's is allocated; the collapse before a materialization happens
  before the new full tensor is allocated. At most one full parameter exists at a time, except
  for the parameters of one operation that reads several (``p.copy_(q)``).
- An operation that overwrites every element (``normal_``, ``uniform_``, ``zero_``, ``fill_``,
  ``copy_``: what initialisers do) gets an uninitialised full tensor instead of a gather (no
  collective, no receive buffer), and the gathered buffer is viewed as the parameter, not copied.
- Chunks are carved out of large slabs (:class:`ChunkArena`), not allocated one by one: small
  long-lived chunks between the transient full tensors fragment glibc's heap. Slabs are above
  glibc's largest mmap threshold, so each is a mapping of its own, unmapped when freed.
- Freed full tensors still leave free pages in the heap (glibc keeps them); they are returned to
  the system every :data:`TRIM_BYTES` freed (:mod:`zeroshard.core.host_memory`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from zeroshard.core import host_memory
from zeroshard.core.comm import collectives as C
from zeroshard.core.partition import ShardLayout
from zeroshard.errors import ZeroshardError

aten = torch.ops.aten

#: Bytes per chunk slab: above glibc's largest dynamic mmap threshold (32 MiB on 64-bit), so a
#: slab is always its own mapping. Pages of a slab that no chunk uses are never touched, hence
#: never resident.
SLAB_BYTES = 64 * 2**20
#: Bytes of full parameters freed after which ``zero.Init`` returns free heap pages (CPU).
TRIM_BYTES = 8 * 2**20
#: Chunk offsets inside a slab are multiples of this many bytes (vector loads stay aligned).
_ALIGN = 64

#: In-place operations whose result does not depend on the previous values of their first
#: argument: a parameter they write needs no gather first.
_OVERWRITES = {
    aten.normal_.default, aten.uniform_.default, aten.zero_.default, aten.fill_.Scalar,
    aten.fill_.Tensor, aten.copy_.default, aten.bernoulli_.float, aten.exponential_.default,
    aten.geometric_.default, aten.log_normal_.default, aten.cauchy_.default, aten.random_.default,
    aten.random_.to, getattr(aten.random_, "from"),
}


class ChunkArena:
    """Bump allocator of chunks inside large slabs, one open slab per (dtype, device).

    A chunk is a view of its slab; the slab is freed when the last view is gone (after the
    engine copies the chunks into its own buffers).
    """

    def __init__(self, spill_dir: str | None = None) -> None:
        self._open: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, int]] = {}
        #: ``zero.Init(remote_device="nvme")``: host slabs are file-backed buffers in this directory,
        #: and each chunk's pages leave the process once written (:meth:`written`)
        self.spill_dir = spill_dir

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised 1-D tensor of ``numel`` elements carved from a slab."""
        item = torch.empty((), dtype=dtype).element_size()
        align = max(1, _ALIGN // item)
        key = (dtype, device)
        slab, used = self._open.get(key, (None, 0))
        if slab is None or used + numel > slab.numel():
            # A chunk larger than a slab gets a slab of its own (also a mapping of its own).
            size = max(SLAB_BYTES // item, numel)
            if self.spill_dir is not None and device.type == "cpu":
                slab = host_memory.FileMappedBuffer(self.spill_dir, size * item).tensor(dtype)
            else:
                slab = torch.empty(size, dtype=dtype, device=device)
            used = 0
        out = slab[used : used + numel]
        self._open[key] = (slab, -(-(used + numel) // align) * align)
        return out

    def written(self, chunk: torch.Tensor) -> None:
        """``chunk`` holds its values: with a spill directory its pages leave the process (they stay
        in the page cache, and the file)."""
        if self.spill_dir is not None:
            host_memory.drop_file_pages(chunk)

    def close(self) -> None:
        """Forget the open slabs (their used parts stay alive through the chunks)."""
        self._open.clear()


class ShardCore:
    """The storage behind one parameter: this rank's chunk, or the full values while cached."""

    def __init__(self, full: torch.Tensor, session: InitSession) -> None:
        self.shape = full.shape
        self.dtype = full.dtype
        self.layout = ShardLayout(full.numel(), session.world)
        self.session = session
        self.chunk: torch.Tensor | None = None
        #: this parameter's place in the chunk arena, kept while the values are full: a slab
        #: frees nothing before all its chunks go, so a re-collapse writes back where it was
        self._slot: torch.Tensor | None = None
        self.full: torch.Tensor | None = full
        # Partitioned at once: the constructor's full tensor is freed before the next parameter's
        # is allocated, so at most one full parameter exists at a time (initialisers that
        # overwrite it later need no gather, see ``_OVERWRITES``).
        session.cache(self)
        session.flush()

    def materialize(self, overwrite: bool = False) -> torch.Tensor:
        """Full values (gathered from every rank's chunk unless cached). With ``overwrite`` the
        caller is about to write every element: the values are left uninitialised, no gather."""
        if self.full is None:
            assert self.chunk is not None
            self.session.make_room(self)  # collapse the cached parameter before allocating this one
            k = self.layout.shard_numel
            # One buffer of world * k elements, viewed as the full tensor (the padding past
            # ``numel`` is never read): no second full-size copy.
            out = torch.empty(k * self.session.world, dtype=self.dtype, device=self.chunk.device)
            if not overwrite:
                padded = torch.zeros(k, dtype=self.dtype, device=self.chunk.device)
                padded[: self.chunk.numel()] = self.chunk
                C.all_gather(out, padded, self.session.group, async_op=False)
            self.full = out[: self.layout.numel].view(self.shape)
            self.session.chunk_bytes -= self.chunk.numel() * self.chunk.element_size()
            self._slot, self.chunk = self.chunk, None
        self.session.cache(self)
        return self.full

    def collapse(self) -> None:
        """Keep only this rank's chunk of rank 0's full values."""
        if self.full is None:
            return
        full = self.full.contiguous()
        C.broadcast(full, src=0, group=self.session.group)
        s, e = self.layout.local_range(self.session.rank)
        slot = self._slot if self._slot is not None else self.session.arena.take(e - s, full.dtype, full.device)
        self.chunk, self._slot = slot.copy_(full.view(-1)[s:e]), None
        self.session.arena.written(self.chunk)
        self.full = None
        del full
        self.session.chunk_bytes += self.chunk.numel() * self.chunk.element_size()
        if self.chunk.device.type == "cpu":
            self.session.trim.freed(self.layout.numel * self.chunk.element_size())


class InitSession:
    """State of one ``zero.Init`` context: the group and the full parameters cached now (the one
    last used, or every parameter of the operation running now)."""

    def __init__(self, group: dist.ProcessGroup | None, spill_dir: str | None = None) -> None:
        self.group = group
        self.world = C.world_size(group)
        self.rank = C.rank(group)
        self.cached: list[ShardCore] = []
        #: cores read or written by the operation running now: none of them may collapse before
        #: it has run (``p.copy_(q)`` with both lazy needs both full at once)
        self.in_use: list[ShardCore] = []
        self.arena = ChunkArena(spill_dir)
        # The full tensors freed between chunks fragment glibc's heap: return the free pages
        # every few MiB, or the process grows by more than the model (see host_memory).
        self.trim = host_memory.TrimEvery(TRIM_BYTES)
        self.chunk_bytes = 0
        #: most bytes of parameter values held at once (chunks + the full parameters cached)
        self.peak_bytes = 0

    def make_room(self, core: ShardCore) -> None:
        """Collapse every cached parameter except ``core`` and those the running operation uses."""
        keep = [c for c in self.cached if c is core or any(c is u for u in self.in_use)]
        for c in self.cached:
            if not any(c is k for k in keep):
                c.collapse()
        self.cached = keep

    def cache(self, core: ShardCore) -> None:
        """``core`` holds full values now: it stays so until another parameter is needed."""
        self.make_room(core)
        if not any(c is core for c in self.cached):
            self.cached.append(core)
        full = sum(c.full.numel() * c.full.element_size() for c in self.cached if c.full is not None)
        self.peak_bytes = max(self.peak_bytes, self.chunk_bytes + full)

    def flush(self) -> None:
        """Collapse every cached parameter."""
        for c in self.cached:
            c.collapse()
        self.cached = []

    def close(self) -> None:
        """End of the ``zero.Init`` block: collapse, close the arena, return free heap pages."""
        self.flush()
        self.arena.close()
        host_memory.trim()


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

    @property  # type: ignore[override]
    def data(self) -> LazyShardTensor:
        """The same values without autograd history (reads and writes reach the chunk)."""
        return LazyShardTensor(self.core)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        # torch's own setter swaps the storage under the wrapper, and the values written would be
        # lost: ``self.w.data = self.w.data + 1`` in a constructor, ``module.cpu()`` inside the block.
        if isinstance(value, LazyShardTensor) and value.core is self.core:
            return
        if tuple(value.shape) != tuple(self.shape):
            raise ZeroshardError(f"zero.Init: a parameter of shape {tuple(self.shape)} had its .data replaced by a "
                                 f"tensor of shape {tuple(value.shape)}: a partitioned parameter keeps its shape; "
                                 "build it with the new shape instead")
        with torch.no_grad():
            LazyShardTensor(self.core).copy_(value)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"LazyShardTensor(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return LazyShardTensor(args[0].core)
        cores: dict[int, ShardCore] = {}
        lazy = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, LazyShardTensor)]
        target = args[0].core if func in _OVERWRITES and args and isinstance(args[0], LazyShardTensor) else None
        # ``p.copy_(p)`` reads what it writes: only a target read by nothing else skips the gather.
        if target is not None and sum(x.core is target for x in lazy) > 1:
            target = None
        session = lazy[0].core.session
        session.in_use = [x.core for x in lazy]

        def unwrap(x: Any) -> Any:
            if isinstance(x, LazyShardTensor):
                full = x.core.materialize(overwrite=x.core is target)
                cores[id(full)] = x.core
                return full
            return x

        try:
            out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs))
        finally:
            session.in_use = []
        # An in-place op returns its (full) argument: hand back the lazy tensor instead.
        return pytree.tree_map(lambda o: LazyShardTensor(cores[id(o)]) if id(o) in cores else o, out)
