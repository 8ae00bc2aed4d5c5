"""The hooks of activation offload (``zeroshard.activations.offload``): what moves, what comes back.

On a CPU run DeepSpeed's semantics skip marked host tensors (they are in host memory already); the
tests of the copy path use ``offload_cpu_tensors=True``, which runs host tensors through the same
copy-out/copy-back code as device tensors (side streams aside). DeepSpeed's own tests of this
class (``test_offload_activations.py``) run through the conformance runner.
"""

from __future__ import annotations

import gc
import weakref
from functools import partial
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zeroshard
from zeroshard.activations import HiddenStatesOffload, current_offload, unconfigure
from zeroshard.deepspeed.accelerator import get_accelerator
from zeroshard.deepspeed.activation_offload import (
    CheckpointHiddenStatesOffload,
    get_checkpoint_hidden_states_offloading_ctx_manager,
)


def _layers(n: int = 4, dim: int = 16) -> nn.ModuleList:
    torch.manual_seed(3)
    return nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(n))


def _run(layers: nn.ModuleList, x: torch.Tensor, manager: HiddenStatesOffload | None = None,
         ckpt: object = partial(checkpoint, use_reentrant=False)) -> tuple[torch.Tensor, list[torch.Tensor]]:
    h, marked = x, []
    for layer in layers:
        if manager is not None:
            manager.mark(h)
            marked.append(h)
        h = ckpt(layer, h)  # type: ignore[operator]
    return h.square().sum(), marked


def _grads(layers: nn.ModuleList, x: torch.Tensor) -> list[torch.Tensor]:
    return [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]  # type: ignore[union-attr]


def _baseline(layers: nn.ModuleList, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss, _ = _run(layers, x)
    loss.backward()
    out = _grads(layers, x)
    layers.zero_grad(set_to_none=True)
    x.grad = None
    return loss.detach(), out


def test_cpu_default_skips_host_tensors_and_changes_nothing() -> None:
    layers, x = _layers(), torch.randn(8, 16, requires_grad=True)
    want_loss, want = _baseline(layers, x)
    manager = HiddenStatesOffload(use_streams=False, min_offload_bytes=0)
    with manager:
        loss, _ = _run(layers, x, manager)
        loss.backward()
    assert torch.equal(loss, want_loss) and all(torch.equal(a, b) for a, b in zip(_grads(layers, x), want))
    s = manager.stats
    assert s.marked_tensors == 4 and s.skipped_marked_tensors == 4
    assert s.offloaded_tensors == s.restored_tensors == s.offloaded_bytes == s.peak_host_bytes == 0


@pytest.mark.parametrize("keep", [0, 1, 2])
def test_marked_inputs_move_to_host_buffers_and_come_back_equal(keep: int) -> None:
    layers, x = _layers(), torch.randn(8, 16, requires_grad=True)
    want_loss, want = _baseline(layers, x)
    manager = HiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=keep,
                                  offload_cpu_tensors=True)
    with manager:
        loss, marked = _run(layers, x, manager)
        # the buffers hold copies of the offloaded inputs (the oldest ones), not the tensors themselves
        buffers = [tracked[0] for tracked in manager._tracker.values()]
        assert len(buffers) == 4 - keep
        for buf, h in zip(buffers, marked):
            assert torch.equal(buf, h.detach()) and buf.data_ptr() != h.data_ptr()
        assert list(manager._keep_last.values()) == marked[len(marked) - keep:]
        assert manager.stats.host_bytes == manager.stats.offloaded_bytes == (4 - keep) * 8 * 16 * 4
        loss.backward()
    assert torch.equal(loss, want_loss) and all(torch.equal(a, b) for a, b in zip(_grads(layers, x), want))
    s = manager.stats
    assert s.offloaded_tensors == s.restored_tensors == 4 - keep and s.kept_last_tensors == keep
    assert s.restored_bytes == s.offloaded_bytes and s.peak_host_bytes == s.offloaded_bytes
    assert s.host_bytes == 0 and not manager._tracker  # backward freed every buffer
    assert manager._cpu_buffer_pool_count == 4 - keep  # ... into the pool


def test_the_graph_holds_the_host_copy_not_the_tensor() -> None:
    layers = _layers(2)
    manager = HiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=0,
                                  offload_cpu_tensors=True)
    with manager:
        # an intermediate nothing else saves (a Linear's output, as a residual sum in a transformer)
        h = layers[0][0](  # type: ignore[index]
            torch.randn(8, 16, requires_grad=True))
        alive = weakref.ref(h)
        value = h.detach().clone()
        manager.mark(h)
        loss = checkpoint(layers[1], h, use_reentrant=False).sum()
        del h
        gc.collect()
        assert alive() is None  # moved: the device-side tensor is freed
        assert torch.equal(next(iter(manager._tracker.values()))[0], value)
        loss.backward()
    assert manager.stats.restored_tensors == 1


def test_backward_reads_the_host_buffer() -> None:
    """Changing the buffer between forward and backward changes the gradients: the restore reads it."""
    layers, x = _layers(2), torch.randn(8, 16, requires_grad=True)
    _, want = _baseline(layers, x)
    manager = HiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=0,
                                  offload_cpu_tensors=True)
    with manager:
        loss, _ = _run(layers, x, manager)
        for tracked in manager._tracker.values():
            tracked[0].add_(1.0)
        loss.backward()
    assert not torch.equal(_grads(layers, x)[0], want[0])


class _Recording(HiddenStatesOffload):
    """Keeps what each restore returned."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: list[torch.Tensor] = []

    def _restore_tensor(self, tensor_id: int) -> torch.Tensor:
        self.seen.append(super()._restore_tensor(tensor_id))
        return self.seen[-1]


def test_views_come_back_with_their_strides() -> None:
    fn = nn.Tanh()
    base = torch.randn(6, 8)
    for view in (base[2:], base[:, ::2]):
        x = view.detach().requires_grad_(True)
        ref = torch.empty_strided(x.size(), x.stride()).copy_(x.detach()).requires_grad_(True)
        checkpoint(fn, ref, use_reentrant=False).square().sum().backward()
        manager = _Recording(use_streams=False, min_offload_bytes=0, keep_last_count=0, offload_cpu_tensors=True)
        with manager:
            manager.mark(x)
            checkpoint(fn, x, use_reentrant=False).square().sum().backward()
        assert manager.stats.restored_tensors == 1 and torch.equal(x.grad, ref.grad)  # type: ignore[arg-type]
        assert manager.seen[0].stride() == x.stride() and torch.equal(manager.seen[0], x.detach())
        assert next(iter(manager._cpu_buffer_pool.values()))[0].is_contiguous()  # the host buffer is dense


def test_overlapping_small_and_parameter_tensors_stay() -> None:
    manager = HiddenStatesOffload(use_streams=False, min_offload_bytes=64, offload_cpu_tensors=True)
    assert manager.offload_input(torch.randn(4, 8).expand(2, 4, 8)) is None  # zero stride
    assert manager.offload_input(torch.randn(3)) is None  # 12 bytes < 64
    assert manager.offload_input(nn.Parameter(torch.randn(64))) is None
    assert manager.stats.skipped_marked_tensors == 3


def test_retain_graph_restores_again_from_the_same_buffer() -> None:
    layers, x = _layers(), torch.randn(8, 16, requires_grad=True)
    _, want = _baseline(layers, x)
    manager = HiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=1,
                                  offload_cpu_tensors=True)
    with manager:
        loss, _ = _run(layers, x, manager)
        loss.backward(retain_graph=True)
        assert manager.stats.host_bytes == 3 * 8 * 16 * 4  # the retained graph still holds its buffers
        layers.zero_grad(set_to_none=True)
        x.grad = None
        loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(layers, x), want))
    assert manager.stats.restored_tensors == 3  # each counted once
    del loss
    gc.collect()
    assert manager.stats.host_bytes == 0


def test_a_graph_dropped_without_backward_frees_its_buffers() -> None:
    layers, x = _layers(), torch.randn(8, 16, requires_grad=True)
    manager = HiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=0,
                                  offload_cpu_tensors=True)
    with manager:
        loss, marked = _run(layers, x, manager)
        assert manager.stats.host_bytes > 0
        del loss, marked
        gc.collect()
        assert manager.stats.host_bytes == 0 and not manager._tracker and not manager._keep_last


def test_pooled_buffers_are_reused_across_steps() -> None:
    layers, x = _layers(), torch.randn(8, 16, requires_grad=True)
    manager = get_checkpoint_hidden_states_offloading_ctx_manager(use_streams=True, min_offload_bytes=0,
                                                                  keep_last_count=0)
    manager.offload_cpu_tensors = True
    pointers = []
    for _ in range(2):
        with manager:
            loss, _ = _run(layers, x, manager)
            pointers.append(sorted(t[0].data_ptr() for t in manager._tracker.values()))
            loss.backward()
    assert pointers[0] == pointers[1] and manager._cpu_buffer_pool_count == 4


def test_zeroshard_checkpointing_hands_marked_inputs_to_the_manager() -> None:
    unconfigure()
    layers, x = _layers(), torch.randn(8, 16, requires_grad=True)
    _, want = _baseline(layers, x)
    manager = HiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=0,
                                  offload_cpu_tensors=True)
    with manager:
        assert current_offload() is manager
        loss, _ = _run(layers, x, manager, ckpt=zeroshard.checkpointing.checkpoint)
        loss.backward()
    assert current_offload() is None
    assert manager.stats.offloaded_tensors == manager.stats.restored_tensors == 4
    assert all(torch.equal(a, b) for a, b in zip(_grads(layers, x), want))


def test_arguments_and_reentry() -> None:
    for name in ("keep_last_count", "max_fwd_stash_count", "max_cpu_buffer_pool_count", "min_offload_bytes"):
        kwargs: dict[str, Any] = {name: -1}
        with pytest.raises(ValueError, match=name):
            HiddenStatesOffload(**kwargs)
    manager = HiddenStatesOffload()
    with manager, pytest.raises(RuntimeError, match="not re-entrant"):
        manager.__enter__()
    assert current_offload() is None


def test_deepspeed_class_pins_through_the_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    accel = get_accelerator()
    pin = accel.pin_memory

    def counted(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(t)
        return pin(t)

    monkeypatch.setattr(accel, "pin_memory", counted)
    buf, key = CheckpointHiddenStatesOffload(use_pin_memory=True)._empty_cpu_like(torch.randn(6, 8)[:, ::2])
    assert len(calls) == 1 and buf.is_contiguous() and key == ((6, 4), torch.float32, torch.strided, True)
    HiddenStatesOffload(use_pin_memory=False)._empty_cpu_like(torch.randn(2))
    assert len(calls) == 1


def test_hugging_face_layers_are_marked() -> None:
    transformers = pytest.importorskip("transformers")
    layer_cls = getattr(transformers, "GradientCheckpointingLayer", None)
    if layer_cls is None:
        pytest.skip("transformers without GradientCheckpointingLayer")

    class Layer(layer_cls):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.lin(hidden_states))

    layers = [Layer() for _ in range(3)]
    for layer in layers:
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
    original = layer_cls.__call__
    x = torch.randn(4, 8, requires_grad=True)
    manager = HiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=0,
                                  offload_cpu_tensors=True)
    with manager:
        assert layer_cls.__call__ is not original
        h = x
        for layer in layers:
            h = layer(h)
        h.sum().backward()
    assert layer_cls.__call__ is original
    assert manager.stats.marked_tensors == manager.stats.offloaded_tensors == manager.stats.restored_tensors == 3


def test_offload_input_and_restore_input_by_id() -> None:
    manager = HiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=0,
                                  offload_cpu_tensors=True)
    t = torch.randn(5, 3)
    tensor_id = manager.offload_input(t)
    assert tensor_id is not None and manager.stats.host_bytes == t.nbytes
    back = manager.restore_input(tensor_id)
    assert torch.equal(back, t) and back.data_ptr() != t.data_ptr()
    assert manager.stats.host_bytes == 0 and manager._cpu_buffer_pool_count == 1


def test_a_llama_trains_as_without() -> None:
    """A Hugging Face model with gradient checkpointing needs no change: each decoder layer's input is
    marked, offloaded and restored, and the gradients are those without offload."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})  # transformers 5.24 renamed gradient_checkpointing_enable
    model.train()
    ids = torch.randint(0, 64, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    manager = HiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=1,
                                  offload_cpu_tensors=True)
    with manager:
        model(input_ids=ids, labels=ids).loss.backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(want, model.parameters()))  # type: ignore[arg-type]
    s = manager.stats
    assert s.marked_tensors == 3 and s.offloaded_tensors == s.restored_tensors == 2 and s.kept_last_tensors == 1
    assert s.offloaded_bytes == 2 * 2 * 16 * 32 * 4 and s.host_bytes == 0


def test_reentrant_checkpoint_offloads_too() -> None:
    """torch's reentrant checkpoint saves its inputs with save_for_backward: the marked one moves."""
    layers, x = _layers(), torch.randn(8, 16, requires_grad=True)
    _, want = _baseline(layers, x)
    manager = HiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=0,
                                  offload_cpu_tensors=True)
    with manager:
        loss, _ = _run(layers, x, manager, ckpt=partial(checkpoint, use_reentrant=True))
        loss.backward()
    assert manager.stats.offloaded_tensors == manager.stats.restored_tensors == 4
    assert all(torch.equal(a, b) for a, b in zip(_grads(layers, x), want))
