"""zeroshard's own large host buffers live outside malloc's heap and give their pages back."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
import torch

from zeroshard.core import host_memory

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


def test_trim_sites_follow_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default zeroshard trims at set-up and as ZeRO-3 releases units in training, not at every
    backward and step; ``1`` adds those, ``0`` turns every trim off."""
    if host_memory._MALLOC_TRIM is None:
        pytest.skip("no malloc_trim in this C library")
    expected = {"": (True, True, False), "1": (True, True, True), "0": (False, False, False)}
    for mode, want in expected.items():
        monkeypatch.setenv("ZEROSHARD_MALLOC_TRIM", mode)
        assert tuple(host_memory.enabled(site) for site in ("setup", "release", "step")) == want, mode


def test_zero3_training_on_cpu_trims_as_units_are_released(monkeypatch: pytest.MonkeyPatch,
                                                           process_group: None) -> None:
    """One rank, stage 3, the whole model released in each backward: with the default setting the
    released units' bytes reach the trim interval and malloc_trim runs during training; with
    ``ZEROSHARD_MALLOC_TRIM=0`` it never does."""
    if host_memory._MALLOC_TRIM is None:
        pytest.skip("no malloc_trim in this C library")
    import zeroshard
    from zeroshard.core.zero3 import coordinator

    calls: list[int] = []
    monkeypatch.setattr(host_memory, "_MALLOC_TRIM", lambda pad: calls.append(pad) or 0)
    monkeypatch.setattr(coordinator, "TRIM_BYTES", 1 << 20)  # a small model reaches it each step
    counts = {}
    for mode in ("", "0"):
        monkeypatch.setenv("ZEROSHARD_MALLOC_TRIM", mode)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
        engine, *_ = zeroshard.initialize(model=model, config={
            "train_batch_size": 4, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
        calls.clear()
        for _ in range(3):
            engine.backward(engine(torch.randn(4, 256)).square().mean())
            engine.step()
        counts[mode] = len(calls)
        engine.destroy()
    assert counts[""] >= 3 and counts["0"] == 0, counts


def test_discard_removes_whole_pages_and_keeps_the_edges(tmp_path) -> None:
    """A discarded range's whole pages read as zeros (removed from the file), the partial pages at
    its ends keep every byte (they hold bytes outside the range too)."""
    page = mmap.PAGESIZE
    buf = host_memory.FileMappedBuffer(tmp_path, 4 * page)
    t = buf.tensor(torch.uint8)
    t.fill_(7)
    removed = buf.discard(page // 2, 2 * page + 10)  # [page/2, 2.5 page + 10): one whole page inside
    if removed == 0 and bool((t[page : 2 * page] == 7).all()):
        pytest.skip("this filesystem does not punch holes")
    assert removed == page and buf.discarded == page
    assert bool((t[page : 2 * page] == 0).all())
    assert bool((t[:page] == 7).all()) and bool((t[2 * page :] == 7).all())
    assert buf.discard(10, 20) == 0 and bool((t[:page] == 7).all())  # inside one page: nothing removed
