"""Activation offload on a GPU (skipped without CUDA; CI has none): the marked checkpoint inputs leave
device memory for page-locked host buffers and come back, with and without side streams.

Run on a GPU machine with ``python3 -m pytest -q tests/gpu/test_activation_offload_cuda.py``; DeepSpeed's
own tests of the class (14 of them need a GPU) run there with ``conformance/run.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from zeroshard.activations import HiddenStatesOffload, current_offload
from zeroshard.deepspeed.accelerator import get_accelerator

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LAYERS, ROWS, DIM = 8, 4096, 1024  # each block input: 16 MiB in fp32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.nn.functional.gelu(self.up(h)))


def _model() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Block() for _ in range(LAYERS)).cuda()


def _forward(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    h = x
    for block in blocks:
        offload = current_offload()
        if offload is not None:
            offload.mark(h)
        h = checkpoint(block, h, use_reentrant=False)
    return h.square().mean()


def _grads(blocks: nn.ModuleList) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in blocks.parameters()]  # type: ignore[union-attr]
    blocks.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("use_streams", [False, True])
@pytest.mark.parametrize("keep", [0, 1])
def test_offload_restores_exact_values(use_streams: bool, keep: int) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    blocks, x = _model(), torch.randn(ROWS, DIM, device="cuda")
    _forward(blocks, x).backward()
    want = _grads(blocks)
    manager = HiddenStatesOffload(use_streams=use_streams, keep_last_count=keep)
    for _ in range(2):  # the second step reuses the pooled host buffers
        with manager:
            loss = _forward(blocks, x)
            for host, *_ in manager._tracker.values():
                assert host.device.type == "cpu" and get_accelerator().is_pinned(host)
            loss.backward()
        got = _grads(blocks)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        s = manager.stats
        assert s.offloaded_tensors == s.restored_tensors == LAYERS - keep and s.kept_last_tensors == keep
    assert manager._cpu_buffer_pool_count == LAYERS - keep and manager.stats.host_bytes == 0


def test_offload_frees_device_memory() -> None:
    blocks, x = _model(), torch.randn(ROWS, DIM, device="cuda")
    _forward(blocks, x).backward()  # gradients allocated
    held = []
    for manager in (None, HiddenStatesOffload(use_streams=False, keep_last_count=0)):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with manager if manager is not None else torch.enable_grad():
            loss = _forward(blocks, x)
            torch.cuda.synchronize()
            held.append(torch.cuda.memory_allocated() - before)
            loss.backward()
    hidden = ROWS * DIM * 4
    # the inputs of blocks 2..8 (block 1's is x, which the caller holds anyway) left the device
    assert held[0] - held[1] >= 0.95 * (LAYERS - 1) * hidden, held
