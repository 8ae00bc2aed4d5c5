"""Activation offload: the marked inputs of checkpointed regions wait in host memory for backward.

DeepSpeed's ``CheckpointHiddenStatesOffload`` (``deepspeed.runtime.activation_checkpointing.
offload_activations``), written for zeroshard: a :class:`torch.autograd.graph.saved_tensors_hooks`
context manager. Inside it, every tensor autograd saves passes through :meth:`~HiddenStatesOffload.
_pack_tensor`; the ones the caller *marked* (:meth:`~HiddenStatesOffload.mark`, the hidden states a
``torch.utils.checkpoint`` region keeps as its input, reentrant or not) are copied to a host buffer and
the graph keeps a small reference instead of the tensor. Backward's unpack copies the buffer back
to a fresh tensor on the original device, with the original shape and strides. Everything else
autograd saves passes through untouched.

Where a tensor is:

- **on CUDA**: it is copied to host memory (page-locked with ``use_pin_memory``), on a side stream
  that waits for the compute stream (``use_streams``; otherwise on the compute stream), so the copy
  overlaps the next layers' compute. The newest ``keep_last_count`` marked tensors stay on the
  device (the first backward needs them before a copy would finish); a device tensor's memory
  goes back to torch's allocator once its copy has run (``record_stream``), except for the newest
  ``max_fwd_stash_count`` offloaded ones, kept until newer ones replace them or backward uses them
  (without a copy back).
  Copies back run on the side stream too, and the compute stream waits for them.
- **in host memory already** (a CPU run): nothing to move. It is counted
  (``stats.skipped_marked_tensors``) and kept as is, as DeepSpeed does: offload on a CPU run is the
  identity and changes neither memory nor results. ``offload_cpu_tensors=True`` (zeroshard's
  option, not DeepSpeed's) runs host tensors through the same copy-out/copy-back path as device
  tensors, into a separate host buffer: for tests and for accounting of what would be moved (see
  ``benchmarks/activation_offload_memory.py``); on a CPU run it frees nothing, it only copies.

Also skipped (kept as they are): tensors under ``min_offload_bytes``, parameters and buffers,
overlapping views (a zero stride: the restore could not rebuild them), non-strided layouts.

Lifetimes: a host buffer belongs to its packed reference and returns to the manager's buffer pool
when autograd drops that reference (after the backward that used it, or with the graph), so a
graph kept with ``retain_graph=True`` can be unpacked again, restored from the same buffer. A
restored tensor is not kept by the manager beyond the tensors still using it (a weak cache answers
a second unpack while the first result is alive). ``stats`` counts each offloaded tensor's first
restore. Reusing one manager for many steps reuses its pooled buffers (no new pinned allocations).

Hugging Face layers: while a manager is active and ``transformers`` is imported, the
``hidden_states`` argument of every ``GradientCheckpointingLayer`` that checkpoints is marked
automatically (``GradientCheckpointingLayer.__call__`` is patched while any manager is active and
restored when the last one exits).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

__all__ = ["HiddenStatesOffload", "OffloadStats", "OffloadedTensorRef", "current_offload", "offloading"]


@dataclass
class OffloadStats:
    """Counters of one manager since it was last entered (DeepSpeed's
    ``CheckpointActivationOffloadStats``, plus the host bytes held now and at most)."""

    saved_tensors_seen: int = 0
    """Tensors autograd saved inside the context (each passes through the pack hook)."""
    marked_tensors: int = 0
    """Calls to :meth:`HiddenStatesOffload.mark`."""
    offloaded_tensors: int = 0
    """Marked tensors copied to host memory."""
    restored_tensors: int = 0
    """Offloaded tensors brought back by backward (each counted once)."""
    skipped_marked_tensors: int = 0
    """Marked tensors kept where they were (in host memory already, small, a parameter, ...)."""
    kept_last_tensors: int = 0
    """Marked tensors unpacked from the device because they were among the last ``keep_last_count``."""
    offloaded_bytes: int = 0
    restored_bytes: int = 0
    host_bytes: int = 0
    """Bytes of host buffers held for backward now."""
    peak_host_bytes: int = 0
    """Most bytes of host buffers held for backward at once."""


class OffloadedTensorRef:
    """What the autograd graph keeps in place of an offloaded tensor; dropping it frees its buffer."""

    __slots__ = ("tensor_id", "_owner", "__weakref__")

    def __init__(self, tensor_id: int, owner: HiddenStatesOffload) -> None:
        self.tensor_id = tensor_id
        self._owner = weakref.ref(owner)

    def __repr__(self) -> str:
        return f"OffloadedTensorRef({self.tensor_id})"

    def unpack(self) -> torch.Tensor:
        """The tensor, back on its device."""
        owner = self._owner()
        if owner is None:
            raise RuntimeError(f"offloaded activation {self.tensor_id}: its HiddenStatesOffload no longer exists")
        return owner._restore_tensor(self.tensor_id)

    def __del__(self) -> None:
        owner = self._owner()
        if owner is not None:
            try:
                owner._release(self.tensor_id)
            except Exception:  # noqa: BLE001, S110 - at interpreter exit the module may be half torn down
                pass


_BufferKey = tuple[tuple[int, ...], torch.dtype, torch.layout, bool]
_Tracked = tuple[torch.Tensor, torch.device, torch.Size, tuple[int, ...], _BufferKey]

_TLS = threading.local()
_PATCH_LOCK = threading.Lock()
_patch: dict[str, Any] = {"wrapper": None, "owned": None, "users": 0}


def _stack() -> list[HiddenStatesOffload]:
    stack = getattr(_TLS, "stack", None)
    if stack is None:
        stack = _TLS.stack = []
    return stack


def current_offload() -> HiddenStatesOffload | None:
    """The innermost active manager of this thread, or None."""
    stack = _stack()
    return stack[-1] if stack else None


def _nbytes(t: torch.Tensor) -> int:
    return t.element_size() * t.nelement()


class HiddenStatesOffload(saved_tensors_hooks):
    """Offload the marked tensors autograd saves inside this context to host memory (module docstring).

    Args:
        use_pin_memory: page-lock the host buffers (through :meth:`_pin`), so copies can overlap.
        use_streams: copy on a side stream (CUDA only; a CPU run has no streams).
        min_offload_bytes: marked tensors smaller than this stay where they are.
        max_fwd_stash_count: the newest offloaded device tensors kept on the device until newer ones
            replace them or backward uses them (CUDA streams only).
        max_cpu_buffer_pool_count: host buffers kept for reuse once freed.
        keep_last_count: the newest marked tensors that stay on the device.
        offload_cpu_tensors: zeroshard's option: copy marked host tensors to host buffers too
            (for tests and accounting; it saves nothing on a CPU run). DeepSpeed skips them.

    Raises:
        ValueError: a negative count or size.
    """

    def __init__(self, use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
                 max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64, keep_last_count: int = 1,
                 offload_cpu_tensors: bool = False) -> None:
        for name, value in (("keep_last_count", keep_last_count), ("max_fwd_stash_count", max_fwd_stash_count),
                            ("max_cpu_buffer_pool_count", max_cpu_buffer_pool_count),
                            ("min_offload_bytes", min_offload_bytes)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        self.use_pin_memory = use_pin_memory
        self.min_offload_bytes = min_offload_bytes
        self.max_fwd_stash_count = max_fwd_stash_count
        self.max_cpu_buffer_pool_count = max_cpu_buffer_pool_count
        self.keep_last_count = keep_last_count
        self.offload_cpu_tensors = offload_cpu_tensors
        self.stats = OffloadStats()
        self._lock = threading.RLock()  # buffers are released from autograd's device threads
        self._next_id = 0
        self._allowed: dict[int, int] = {}
        self._tracker: dict[int, _Tracked] = {}
        self._keep_last: dict[int, torch.Tensor] = {}
        self._fwd_stash: dict[int, tuple[torch.Tensor, Any]] = {}
        self._restored: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._restored_once: set[int] = set()
        self._kept_unpacked: set[int] = set()
        self._cpu_buffer_pool: dict[_BufferKey, list[torch.Tensor]] = {}
        self._cpu_buffer_pool_count = 0
        self._pending_cpu_buffers: list[tuple[_BufferKey, torch.Tensor, Any]] = []
        self._patched = False  # this manager counts among the users of the Hugging Face marker
        self.s1: Any = torch.cuda.Stream() if use_streams and torch.cuda.is_available() else None
        self.use_streams = self.s1 is not None
        super().__init__(self._pack_tensor, self._unpack_tensor)

    # -- marking ------------------------------------------------------------------------------------
    def mark(self, tensor: torch.Tensor) -> None:
        """Offload ``tensor`` when autograd next saves it inside this context (once per mark)."""
        self._allowed[id(tensor)] = self._allowed.get(id(tensor), 0) + 1
        self.stats.marked_tensors += 1

    def _consume_mark(self, tensor: torch.Tensor) -> bool:
        count = self._allowed.get(id(tensor), 0)
        if count <= 0:
            return False
        if count == 1:
            del self._allowed[id(tensor)]
        else:
            self._allowed[id(tensor)] = count - 1
        return True

    # -- the hooks ----------------------------------------------------------------------------------
    def _pack_tensor(self, tensor: torch.Tensor) -> Any:
        self.stats.saved_tensors_seen += 1
        ref = self.pack_marked(tensor)
        return tensor if ref is None else ref

    def _unpack_tensor(self, packed: Any) -> Any:
        return packed.unpack() if isinstance(packed, OffloadedTensorRef) else packed

    def pack_marked(self, tensor: torch.Tensor) -> OffloadedTensorRef | None:
        """If ``tensor`` is marked, consume the mark and offload it: return the reference to keep in
        its place (``ref.unpack()`` brings it back), or None when it is unmarked or stays where it is.
        For saved-tensor hooks that run inside this context and would hide it (``zeroshard.checkpointing``'s)."""
        if not self._consume_mark(tensor):
            return None
        tensor_id = self.offload_input(tensor)
        return None if tensor_id is None else OffloadedTensorRef(tensor_id, self)

    # -- offload ------------------------------------------------------------------------------------
    def _should_skip(self, tensor: torch.Tensor) -> bool:
        on_host = tensor.device.type == "cpu"
        return ((on_host and not self.offload_cpu_tensors) or tensor.layout != torch.strided
                or _nbytes(tensor) < self.min_offload_bytes or isinstance(tensor, torch.nn.Parameter)
                or isinstance(tensor, getattr(torch.nn, "Buffer", ()))
                or (tensor.numel() > 1 and 0 in tensor.stride()))

    def offload_input(self, tensor: torch.Tensor) -> int | None:
        """Take ``tensor`` for offload and return its id, or None when it stays where it is.

        The newest ``keep_last_count`` taken tensors stay on their device; taking one more starts the
        copy of the oldest of them.
        """
        if self._should_skip(tensor):
            self.stats.skipped_marked_tensors += 1
            return None
        self._next_id += 1
        tensor_id = self._next_id
        self._keep_last[tensor_id] = tensor
        while len(self._keep_last) > self.keep_last_count:
            oldest = next(iter(self._keep_last))
            self._start_offload(oldest, self._keep_last.pop(oldest), newest=tensor_id)
        return tensor_id

    def _buffer_key(self, tensor: torch.Tensor) -> _BufferKey:
        # host buffers are dense: sources differing only in strides share them
        return tuple(tensor.size()), tensor.dtype, tensor.layout, self.use_pin_memory

    def _pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """Page-locked ``tensor`` (a copy), where an accelerator exists; else ``tensor``."""
        return tensor.pin_memory() if torch.cuda.is_available() else tensor

    def _empty_cpu_like(self, tensor: torch.Tensor) -> tuple[torch.Tensor, _BufferKey]:
        """A dense host buffer of ``tensor``'s shape and dtype: from the pool, or new (pinned when
        ``use_pin_memory``)."""
        key = self._buffer_key(tensor)
        with self._lock:
            self._reap_pending()
            pool = self._cpu_buffer_pool.get(key)
            if pool:
                self._cpu_buffer_pool_count -= 1
                return pool.pop(), key
        host = torch.empty(tuple(tensor.size()), dtype=tensor.dtype, layout=tensor.layout, device="cpu")
        if self.use_pin_memory:
            host = self._pin(host)
        return host, key

    def _stream(self, tensor: torch.Tensor) -> Any:
        return self.s1 if self.use_streams and tensor.is_cuda else None

    def _start_offload(self, tensor_id: int, tensor: torch.Tensor, newest: int) -> None:
        stream = self._stream(tensor)
        if stream is not None:
            for old in [i for i in self._fwd_stash if i <= newest - self.max_fwd_stash_count]:
                del self._fwd_stash[old]  # record_stream keeps the memory until the copy ends
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            host, key = self._empty_cpu_like(tensor)
            host.copy_(tensor.detach(), non_blocking=stream is not None)
        if stream is not None:
            tensor.record_stream(stream)
            if self.max_fwd_stash_count > 0:
                self._fwd_stash[tensor_id] = (tensor, stream.record_event())
        with self._lock:
            self._tracker[tensor_id] = (host, tensor.device, tensor.size(), tensor.stride(), key)
            self.stats.offloaded_tensors += 1
            self.stats.offloaded_bytes += _nbytes(host)
            self.stats.host_bytes += _nbytes(host)
            self.stats.peak_host_bytes = max(self.stats.peak_host_bytes, self.stats.host_bytes)

    # -- restore ------------------------------------------------------------------------------------
    def _restore_tensor(self, tensor_id: int) -> torch.Tensor:
        kept = self._keep_last.get(tensor_id)
        if kept is not None:
            if tensor_id not in self._kept_unpacked:
                self._kept_unpacked.add(tensor_id)
                self.stats.kept_last_tensors += 1
            return kept
        cached = self._restored.get(tensor_id)
        if cached is not None:  # a second unpack (retain_graph) while the first result lives
            return cached
        stashed = self._fwd_stash.pop(tensor_id, None)
        if stashed is not None:
            tensor, event = stashed
            torch.cuda.current_stream(tensor.device).wait_event(event)
            restored = tensor
        else:
            tracked = self._tracker.get(tensor_id)
            if tracked is None:
                raise RuntimeError(f"offloaded activation {tensor_id} is no longer held: was its graph freed, "
                                   "or the manager reset, before this backward?")
            host, device, shape, stride, _ = tracked
            stream = self.s1 if self.use_streams and device.type == "cuda" else None
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                # fresh storage at offset 0 with the source's strides (the source's offset would
                # index past a dense buffer)
                restored = torch.empty_strided(shape, stride, dtype=host.dtype, device=device)
                restored.copy_(host, non_blocking=stream is not None)
            if stream is not None:
                compute = torch.cuda.current_stream(device)
                compute.wait_event(stream.record_event())
                restored.record_stream(compute)
        if tensor_id not in self._restored_once:
            self._restored_once.add(tensor_id)
            self.stats.restored_tensors += 1
            self.stats.restored_bytes += _nbytes(restored)
        self._restored[tensor_id] = restored
        return restored

    def restore_input(self, tensor_id: int) -> torch.Tensor:
        """The tensor taken as ``tensor_id`` by :meth:`offload_input`, on its device, once: its host
        buffer returns to the pool (DeepSpeed's engine interface, for callers that keep ids rather
        than the hooks' references)."""
        try:
            return self._restore_tensor(tensor_id)
        finally:
            self._release(tensor_id)

    # -- buffer lifetimes ---------------------------------------------------------------------------
    def _release(self, tensor_id: int) -> None:
        """The graph dropped the reference of ``tensor_id``: its buffer goes back to the pool."""
        with self._lock:
            self._keep_last.pop(tensor_id, None)
            self._kept_unpacked.discard(tensor_id)
            self._restored_once.discard(tensor_id)
            self._fwd_stash.pop(tensor_id, None)
            tracked = self._tracker.pop(tensor_id, None)
            if tracked is None:
                return
            host, device, *_, key = tracked
            self.stats.host_bytes -= _nbytes(host)
            if self.use_streams and device.type == "cuda" and self.s1 is not None:
                # a copy from this buffer may still be queued: reuse it once the side stream passes here
                self._pending_cpu_buffers.append((key, host, self.s1.record_event()))
            else:
                self._pool(key, host)

    def _pool(self, key: _BufferKey, host: torch.Tensor) -> None:
        if self._cpu_buffer_pool_count < self.max_cpu_buffer_pool_count:
            self._cpu_buffer_pool.setdefault(key, []).append(host)
            self._cpu_buffer_pool_count += 1

    def _reap_pending(self, wait: bool = False) -> None:
        pending, self._pending_cpu_buffers = self._pending_cpu_buffers, []
        for key, host, event in pending:
            if wait:
                event.synchronize()
            if wait or event.query():
                self._pool(key, host)
            else:
                self._pending_cpu_buffers.append((key, host, event))

    def reset(self) -> None:
        """Zero the counters and forget unconsumed marks; buffers still held by a graph stay held."""
        if self.s1 is not None:
            self.s1.synchronize()
        with self._lock:
            self._reap_pending(wait=True)
            self._allowed.clear()
            self._fwd_stash.clear()
            held = self.stats.host_bytes
            self.stats = OffloadStats(host_bytes=held, peak_host_bytes=held)

    # -- the context --------------------------------------------------------------------------------
    def __enter__(self) -> HiddenStatesOffload:  # type: ignore[override]  # torch's returns None
        if self in _stack():
            raise RuntimeError(f"{type(self).__name__} is not re-entrant; use a separate instance for a "
                               "nested context")
        self._patched = _install_marker()
        try:
            self.reset()
            _stack().append(self)
            super().__enter__()
        except BaseException:
            self._leave()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            if self.s1 is not None:
                self.s1.synchronize()  # copies in flight end before the caller reads anything
            with self._lock:
                self._reap_pending(wait=True)
                self._fwd_stash.clear()
                self._allowed.clear()
        finally:
            try:
                self._leave()
            finally:
                super().__exit__(*exc_info)

    def _leave(self) -> None:
        stack = _stack()
        if self in stack:
            stack.remove(self)
        if self._patched:
            self._patched = False
            _uninstall_marker()


def offloading(**kwargs: Any) -> HiddenStatesOffload:
    """A new :class:`HiddenStatesOffload` (DeepSpeed's ``get_checkpoint_hidden_states_offloading_ctx_manager``)."""
    return HiddenStatesOffload(**kwargs)


# -- Hugging Face: mark GradientCheckpointingLayer's hidden_states ---------------------------------------
def _gradient_checkpointing_layer() -> type | None:
    module = sys.modules.get("transformers")
    if module is None:  # a model built from transformers imported it; nothing to patch otherwise
        return None
    try:
        return getattr(module, "GradientCheckpointingLayer", None)
    except Exception:  # noqa: BLE001 - a lazy module that fails to resolve the name: no such layer
        return None


def _install_marker() -> bool:
    """Patch ``GradientCheckpointingLayer.__call__`` (once) and count a user; False: nothing to patch."""
    with _PATCH_LOCK:
        if _patch["wrapper"] is None:
            layer = _gradient_checkpointing_layer()
            if layer is None:
                return False
            call: Callable[..., Any] = layer.__call__

            def _checkpoint_offload_call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
                manager = current_offload()
                marked = None
                if (manager is not None and self.training and torch.is_grad_enabled()
                        and getattr(self, "gradient_checkpointing", False) and args
                        and isinstance(args[0], torch.Tensor)):
                    marked = args[0]  # hidden_states, the first positional argument, is what is checkpointed
                    manager.mark(marked)
                try:
                    return call(self, *args, **kwargs)
                finally:
                    if marked is not None and manager is not None:
                        manager._consume_mark(marked)  # ids are recycled: drop a mark nothing consumed

            _patch.update(wrapper=_checkpoint_offload_call, owned=layer.__dict__.get("__call__"), layer=layer)
            layer.__call__ = _checkpoint_offload_call  # type: ignore[method-assign]
        _patch["users"] += 1
        return True


def _uninstall_marker() -> None:
    """Count a user out; the last one restores ``GradientCheckpointingLayer.__call__``."""
    with _PATCH_LOCK:
        if _patch["wrapper"] is None:
            return
        _patch["users"] -= 1
        if _patch["users"] > 0:
            return
        layer, wrapper, owned = _patch["layer"], _patch["wrapper"], _patch["owned"]
        _patch.update(wrapper=None, owned=None, layer=None, users=0)
        if layer.__dict__.get("__call__") is not wrapper:
            return  # someone patched over it: leave theirs
        if owned is None:
            delattr(layer, "__call__")
        else:
            layer.__call__ = owned
