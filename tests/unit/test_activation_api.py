"""zeroshard.deepspeed.checkpointing (activation checkpointing) in one process: parity with the model run without
it (dropout included: the recomputation must draw the forward's masks), the memory it saves, measured
two ways, and DeepSpeed's configure()/config-block API.

Memory is measured (a) as bytes held for backward at the end of forward: tensors autograd saved,
seen by an outer ``saved_tensors_hooks`` (distinct storages, weights excluded), plus the
checkpointed inputs zeroshard holds (``STATS``); (b) as the peak of live bytes in torch's CPU
allocator over forward and backward, from the profiler's memory events. RSS is not used: glibc
keeps freed heap pages, so it hides a peak of this size.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import zeroshard
import zeroshard.deepspeed.checkpointing as ckpt
from zeroshard.activations import STATS, configure_from_initialize, current, unconfigure
from zeroshard.config import load_config
from zeroshard.errors import ConfigError

VOCAB, DIM, LAYERS, BATCH, SEQ = 32, 64, 6, 4, 16
#: where the models run: the RNG tracker follows the accelerator's generator, so do they
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Block(nn.Module):
    def __init__(self, tracker_dropout: bool = False) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM), nn.Dropout(0.3)
        self.tracker_dropout = tracker_dropout

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a = F.gelu(self.up(h))
        if self.tracker_dropout:  # Megatron's model-parallel dropout, on the tracker's named state
            with ckpt.get_cuda_rng_tracker().fork():
                a = self.drop(a)
        else:
            a = self.drop(a)
        return h + self.down(a)


class LM(nn.Module):
    def __init__(self, tracker_dropout: bool = False, device: torch.device = DEVICE) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(tracker_dropout) for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)
        self.checkpoint_func: Any = None  # Hugging Face's _gradient_checkpointing_func, or None
        self.to(device)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h) if self.checkpoint_func is None else self.checkpoint_func(block.__call__, h)
        return self.head(h)


@pytest.fixture(autouse=True)
def _fresh_configuration() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add waiting on a loaded machine
    unconfigure()
    yield
    unconfigure()
    torch.set_num_threads(threads)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def loss_of(model: LM) -> torch.Tensor:
    x, y = (t.to(model.head.weight.device) for t in batch())
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def grads(func: Any = None, tracker_dropout: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Gradients of one step with ``func`` as the checkpoint function, and the next random draw."""
    model = LM(tracker_dropout)
    model.checkpoint_func = func
    torch.manual_seed(42)
    if tracker_dropout:
        ckpt.model_parallel_cuda_manual_seed(42)
    loss_of(model).backward()
    after = torch.rand(4, device=DEVICE)  # checkpointing must leave the generator where the plain run leaves it
    return {n: p.grad for n, p in model.named_parameters()}, after


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return any(not torch.allclose(a[n], b[n], rtol=0, atol=1e-5) for n in a)


# --------------------------------------------------------------------------- parity and RNG


def test_parity_with_dropout() -> None:
    plain, plain_next = grads()
    ours, ours_next = grads(ckpt.checkpoint)
    assert_same(plain, ours)
    assert torch.equal(plain_next, ours_next)


def test_parity_needs_the_forward_masks() -> None:
    """The control: recomputing without restoring the generator draws other masks."""
    plain, _ = grads()
    other, _ = grads(functools.partial(ckpt.checkpoint, preserve_rng_state=False))
    assert differs(plain, other)


def test_rng_tracker_states_are_restored_for_the_recomputation() -> None:
    plain, _ = grads(tracker_dropout=True)
    assert_same(plain, grads(ckpt.checkpoint, tracker_dropout=True)[0])
    # torch's checkpoint alone restores the default generator only, not the tracker's state.
    assert differs(plain, grads(functools.partial(torch_checkpoint, use_reentrant=False), tracker_dropout=True)[0])


def test_a_region_recomputed_by_several_backwards() -> None:
    """Each backward through a checkpointed region recomputes it: a gradient penalty's double
    backward, ``autograd.grad`` then ``backward``, and ``retain_graph`` with a backward per loss (a
    shared trunk). It failed at the second recomputation (AttributeError from a one-shot context)."""

    def penalised(func: Any, tracker_dropout: bool) -> dict[str, torch.Tensor]:
        model = LM(tracker_dropout)
        model.checkpoint_func = func
        torch.manual_seed(42)
        if tracker_dropout:
            ckpt.model_parallel_cuda_manual_seed(42)
        x, y = (t.to(DEVICE) for t in batch())
        h = model.embed(x).detach().requires_grad_(True)
        for block in model.blocks:
            h_in = h
            h = block(h) if func is None else func(block.__call__, h)
        loss = F.cross_entropy(model.head(h).reshape(-1, VOCAB), y.reshape(-1))
        (g,) = torch.autograd.grad(loss, h_in, create_graph=True)  # recomputes the last block
        (loss + g.pow(2).sum()).backward(retain_graph=True)  # recomputes every block
        (2 * loss).backward()  # a second loss over the same trunk: recomputes them again
        return {n: p.grad for n, p in model.named_parameters()}

    for tracker_dropout in (False, True):
        assert_same(penalised(None, tracker_dropout), penalised(ckpt.checkpoint, tracker_dropout))


def test_rng_tracker_api() -> None:
    tracker = ckpt.get_cuda_rng_tracker()
    state = torch.cuda.get_rng_state if DEVICE.type == "cuda" else torch.get_rng_state
    ckpt.model_parallel_cuda_manual_seed(3)
    before = state()
    with tracker.fork():
        a = torch.rand(3, device=DEVICE)
    assert torch.equal(state(), before)  # the default generator did not move
    with tracker.fork():
        assert not torch.equal(torch.rand(3, device=DEVICE), a)  # the named state moved on
    with pytest.raises(ValueError, match="seed 2721"):  # 3 + 2718 + model-parallel rank 0
        tracker.add("other", 2721)
    with pytest.raises(KeyError, match="nope"):
        with tracker.fork("nope"):
            pass
    assert ckpt.CudaRNGStatesTracker is type(tracker)


def test_keyword_tensors_and_torch_options() -> None:
    w = torch.randn(DIM, requires_grad=True)
    x = torch.randn(3, DIM, requires_grad=True)

    def fn(a: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.tanh(a * scale)

    fn(x, scale=w).sum().backward()
    expected = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    STATS.reset()
    ckpt.checkpoint(fn, x, scale=w, use_reentrant=True).sum().backward()
    assert STATS.packed == 2  # the keyword tensor is saved like a positional one
    torch.testing.assert_close((x.grad, w.grad), expected, rtol=0, atol=0)


def test_input_modified_in_place_after_forward_is_an_error() -> None:
    x = torch.randn(3, DIM, requires_grad=True)
    h = x * 2
    out = ckpt.checkpoint(torch.tanh, h).sum()
    with torch.no_grad():
        h.add_(1.0)  # the recomputation would run on the new value
    with pytest.raises(RuntimeError, match="modified in place"):
        out.backward()


def test_hugging_face_gradient_checkpointing_func() -> None:
    """``model._set_gradient_checkpointing(True, partial(deepspeed.checkpointing.checkpoint, **kwargs))``."""
    plain, _ = grads()
    assert_same(plain, grads(functools.partial(ckpt.checkpoint, use_reentrant=False))[0])
    assert_same(plain, grads(functools.partial(torch_checkpoint, use_reentrant=True))[0])


def test_transformers_model_if_installed() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ)

    def run(func: Any) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).train()
        if func is not None:  # what gradient_checkpointing_enable() ends in, with DeepSpeed's function
            model._set_gradient_checkpointing(True, gradient_checkpointing_func=func)
        x, _ = batch()
        torch.manual_seed(42)
        STATS.reset()
        model(input_ids=x, labels=x).loss.backward()
        assert STATS.packed == (config.n_layer if func is not None else 0)
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    assert_same(run(None), run(ckpt.checkpoint))


# --------------------------------------------------------------------------- memory


def saved_bytes_at_end_of_forward(func: Any) -> int:
    """Bytes held for backward when forward ends (see the module docstring, (a))."""
    storages: dict[int, int] = {}
    model = LM()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:  # a weight (or its transpose, as addmm saves it) is not an activation
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    model.checkpoint_func = func
    STATS.reset()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(model)
    held = sum(storages.values()) + STATS.live_bytes
    loss.backward()
    assert STATS.live_bytes == 0  # every held input was released by backward
    return held


def peak_allocated_bytes(func: Any) -> int:
    """Peak of live bytes in torch's CPU allocator over forward and backward (module docstring, (b))."""
    from torch.profiler import ProfilerActivity, profile

    model = LM(device=torch.device("cpu"))  # the profiler's memory events here are the CPU allocator's
    model.checkpoint_func = func
    loss_of(model).backward()  # gradients allocated before the measured step, as in training
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss_of(model).backward()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    if not events:
        pytest.skip("this torch build's profiler records no memory events")
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def test_checkpointing_lowers_saved_bytes() -> None:
    plain, ours = saved_bytes_at_end_of_forward(None), saved_bytes_at_end_of_forward(ckpt.checkpoint)
    # Each block keeps only its input (BATCH*SEQ*DIM fp32) instead of ~5 tensors up to 4x as wide.
    assert ours < 0.25 * plain, (plain, ours)
    assert ours >= LAYERS * BATCH * SEQ * DIM * 4


def test_checkpointing_lowers_the_allocator_peak() -> None:
    plain, ours = peak_allocated_bytes(None), peak_allocated_bytes(ckpt.checkpoint)
    assert ours < 0.6 * plain, (plain, ours)


def test_cpu_checkpointing_keeps_inputs_on_the_host() -> None:
    """On a CPU run the inputs are in host memory already: nothing moves, the bytes are the same."""
    ckpt.configure(None, checkpoint_in_cpu=True)
    model = LM()
    model.checkpoint_func = ckpt.checkpoint
    STATS.reset()
    loss = loss_of(model)
    assert STATS.live_bytes == STATS.host_bytes == LAYERS * BATCH * SEQ * DIM * 4
    loss.backward()
    on_host = saved_bytes_at_end_of_forward(ckpt.checkpoint)
    unconfigure()
    assert saved_bytes_at_end_of_forward(ckpt.checkpoint) == on_host
    ckpt.configure(None, checkpoint_in_cpu=True)
    assert_same(grads()[0], grads(ckpt.checkpoint)[0])


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA: on CPU the inputs are in host memory already")
def test_cpu_checkpointing_moves_inputs_off_the_device() -> None:
    def device_bytes_held_after_forward() -> int:
        model = LM()
        model.checkpoint_func = ckpt.checkpoint
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        loss = loss_of(model)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        loss.backward()
        return held

    on_device = device_bytes_held_after_forward()
    ckpt.configure(None, checkpoint_in_cpu=True)
    STATS.reset()
    on_host = device_bytes_held_after_forward()
    assert STATS.peak_bytes == LAYERS * BATCH * SEQ * DIM * 4
    assert on_device - on_host >= LAYERS * BATCH * SEQ * DIM * 4, (on_device, on_host)


# --------------------------------------------------------------------------- configuration


def test_configure_sources_and_precedence(tmp_path: Path) -> None:
    assert not ckpt.is_configured()
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"activation_checkpointing": {"cpu_checkpointing": True, "profile": True}}))
    ckpt.configure(None, deepspeed_config=str(path), profile=False)
    assert ckpt.is_configured() and current().cpu_checkpointing and not current().profile
    block = {"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": {"synchronize_checkpoint_boundary": True}}
    configure_from_initialize(load_config(block, 1))  # an explicit configure() wins
    assert current().cpu_checkpointing and not current().synchronize
    unconfigure()
    configure_from_initialize(load_config(block, 1))
    assert ckpt.is_configured() and current().synchronize and not current().cpu_checkpointing
    configure_from_initialize(load_config({"train_micro_batch_size_per_gpu": 1}, 1))  # no block: defaults
    assert not ckpt.is_configured() and not current().synchronize


def test_configure_errors_name_the_key() -> None:
    with pytest.raises(ConfigError) as e:
        ckpt.configure(None, deepspeed_config={"activation_checkpointing": {"number_checkpoints": 0}})
    assert e.value.key == "activation_checkpointing.number_checkpoints"
    with pytest.raises(ConfigError) as e:
        ckpt.configure(None, deepspeed_config={"activation_checkpointing": {"partition_activation": True}})
    assert e.value.key is not None and e.value.key.startswith("activation_checkpointing.partition_activation")
    with pytest.raises(ConfigError) as e:
        ckpt.configure(object())
    assert e.value.key == "mpu"
    with pytest.raises(ConfigError, match="does not exist"):
        ckpt.configure(None, deepspeed_config="/nonexistent/ds.json")


@pytest.mark.parametrize("kwargs, key", [
    ({"partition_activations": True, "contiguous_checkpointing": True}, "number_checkpoints"),
    ({"contiguous_checkpointing": True, "num_checkpoints": 4}, "partition_activations"),
])
def test_contiguous_checkpointing_alone_is_refused_as_deepspeed(kwargs: dict[str, Any], key: str) -> None:
    """DeepSpeed's configure() refuses these (tests/unit/runtime/activation_checkpointing); a script
    that configures them would fail there, so it fails here too, naming the missing setting."""
    with pytest.raises(ConfigError) as e:
        ckpt.configure(None, **kwargs)
    assert e.value.key == f"activation_checkpointing.{key}"


def test_no_effect_options_are_said(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="zeroshard"):
        ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=4)
    assert "accepted without effect" in caplog.text
    assert "partition_activations has no effect without a model-parallel group" in caplog.text
    assert not current().partitions
    assert_same(grads()[0], grads(ckpt.checkpoint)[0])


def test_profile_and_synchronize_act_at_each_boundary(caplog: pytest.LogCaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[torch.device] = []
    monkeypatch.setattr("zeroshard.activations.function._device.synchronize", synced.append)
    ckpt.configure(None, synchronize=True)
    loss_of_ckpt = LM()
    loss_of_ckpt.checkpoint_func = ckpt.checkpoint
    loss_of(loss_of_ckpt).backward()
    assert len(synced) == 4 * LAYERS  # start and end of each forward and each recomputation
    ckpt.configure(None, profile=True)
    with caplog.at_level(logging.INFO, logger="zeroshard"):
        loss_of(loss_of_ckpt).backward()
    assert caplog.text.count("activation checkpoint forward") == LAYERS
    assert caplog.text.count("activation checkpoint recomputation") == LAYERS


def test_block_is_supported_and_public_names() -> None:
    full = {"partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": True,
            "number_checkpoints": 4, "synchronize_checkpoint_boundary": True, "profile": True}
    assert load_config({"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": full}, 1)
    import zeroshard as deepspeed

    assert deepspeed.checkpointing is ckpt
    for name in ("checkpoint", "configure", "is_configured", "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed",
                 "reset", "non_reentrant_checkpoint", "set_num_layers", "partition_activations_in_checkpoint"):
        assert callable(getattr(deepspeed.checkpointing, name)), name
    assert zeroshard.checkpointing.non_reentrant_checkpoint is ckpt.checkpoint
