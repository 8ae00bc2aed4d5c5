"""zeroshard's own large host buffers live outside malloc's heap and give their pages back."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from zeroshard import host_memory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rss  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
MiB = 2**20


def test_dropped_pages_leave_the_process_and_the_views_stay_usable() -> None:
    buf = host_memory.MappedBuffer(64 * MiB)
    t = buf.tensor(torch.float32)
    view = t[1000:2000].view(10, 100).t()  # like a weight.t() autograd saved
    before = rss.status()["VmRSS"]
    t.fill_(3.0)
    filled = rss.status()["VmRSS"]
    buf.drop()
    dropped = rss.status()["VmRSS"]
    assert filled - before >= 60 * MiB, "filling the buffer should make its pages resident"
    assert filled - dropped >= 60 * MiB, f"drop() kept {(dropped - before) / MiB:.0f} MiB resident"
    assert torch.count_nonzero(t) == 0  # a dropped page reads as zero
    t.fill_(2.0)  # the same tensors are written again (the next gather)
    assert torch.all(view == 2.0)


def test_large_cpu_buffers_are_unmapped_when_freed() -> None:
    before = rss.status()["VmRSS"]
    t = host_memory.empty(16 * MiB, torch.float32, "cpu")  # 64 MiB
    t.fill_(1.0)
    held = rss.status()["VmRSS"]
    del t
    after = rss.status()["VmRSS"]
    assert held - before >= 60 * MiB
    assert held - after >= 60 * MiB, "the mapping should go back to the system when the tensor is freed"


def test_small_or_device_buffers_are_ordinary_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not host_memory.mappable(torch.device("cpu"), host_memory.MAPPED_MIN_BYTES - 1)
    assert not host_memory.mappable(torch.device("meta"), 64 * MiB)
    assert host_memory.mappable(torch.device("cpu"), 64 * MiB)
    monkeypatch.setenv("ZEROSHARD_HOST_MAPPED", "0")
    assert not host_memory.mappable(torch.device("cpu"), 64 * MiB)
    t = host_memory.empty(10, torch.bfloat16, "meta")
    assert t.device.type == "meta" and t.dtype == torch.bfloat16 and t.numel() == 10
