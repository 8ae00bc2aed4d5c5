"""Unit tests of the NVMe offload I/O engine: zeroshard.core.offload.aio and zeroshard.core.offload.swap_files."""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch

from zeroshard.core.offload.aio import ALIGNMENT, AsyncIO, SwapFile, aligned_empty, check_free_space
from zeroshard.core.offload.swap_files import _host, remove_swap_dir, round_up, swap_dir
from zeroshard.errors import ConfigError, OffloadIOError

MODES = ["direct", "buffered"]


def _swap_file(path: Path, nbytes: int, mode: str) -> SwapFile:
    f = SwapFile(path, nbytes, direct=None if mode == "direct" else False)
    if mode == "direct" and not f.direct:
        f.close()
        pytest.skip(f"the filesystem of {path.parent} does not support O_DIRECT")
    return f


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _unaligned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    # One element past an aligned start: an address no O_DIRECT transfer may use as it is.
    return aligned_empty(numel + 1, dtype)[1:]


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("mode", MODES)
def test_round_trip_odd_sizes_dtypes_offsets(tmp_path: Path, mode: str) -> None:
    """Every request lands at its offset (checked against the raw file) and reads back bit-exact."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    offset = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for numel in (1, 3, 1023, 2048, 4097, 70_001):
            for aligned in (True, False):
                src = aligned_empty(numel, dtype) if aligned else _unaligned(numel, dtype)
                src.copy_(torch.randn(numel, generator=gen))
                cases.append((offset, src))
                offset = round_up(offset + src.nbytes + ALIGNMENT)  # a gap of at least one block
    with _swap_file(tmp_path / "swap", offset, mode) as f, AsyncIO(block_size=8192, queue_depth=3, threads=2) as io:
        for h in [io.write(f, off, src, what=f"case {i}") for i, (off, src) in enumerate(cases)]:
            h.wait()
        raw = (tmp_path / "swap").read_bytes()
        outs = [aligned_empty(s.numel(), s.dtype) if i % 3 else _unaligned(s.numel(), s.dtype)
                for i, (_, s) in enumerate(cases)]
        for h in [io.read(f, off, out) for (off, _), out in zip(cases, outs)]:
            h.wait()
        total = sum(s.nbytes for _, s in cases)
        assert (io.bytes_written, io.bytes_read) == (total, total)
    for (off, src), out in zip(cases, outs):
        assert raw[off : off + src.nbytes] == _bytes(src), (off, src.dtype, src.numel())
        assert _bytes(out) == _bytes(src), (off, src.dtype, src.numel())


@pytest.mark.parametrize("mode", MODES)
def test_many_concurrent_requests(tmp_path: Path, mode: str) -> None:
    """64 writes, then 64 reads, all in flight together on 4 threads, each lands in its own place."""
    n, numel = 64, 5000  # 20000 bytes: not a whole number of blocks
    stride = round_up(numel * 4)
    srcs = [torch.full((numel,), float(i)) + torch.arange(numel) for i in range(n)]
    with _swap_file(tmp_path / "swap", n * stride, mode) as f, AsyncIO(block_size=4096, queue_depth=2, threads=4) as io:
        writes = [io.write(f, i * stride, s) for i, s in enumerate(srcs)]
        for h in writes:
            h.wait()
        outs = [torch.empty(numel) for _ in range(n)]
        reads = [io.read(f, i * stride, o) for i, o in enumerate(outs)]
        for h in reversed(reads):
            h.wait()
        assert all(h.done() for h in writes + reads)
    for s, o in zip(srcs, outs):
        torch.testing.assert_close(o, s, rtol=0, atol=0)


@pytest.mark.parametrize(("queue_depth", "threads", "expected"), [(2, 4, 2), (8, 3, 3), (1, 2, 1)])
def test_chunks_in_flight_bounded_by_queue_depth_and_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, queue_depth: int, threads: int, expected: int
) -> None:
    live, peak, lock = [0], [0], threading.Lock()
    real = os.pwrite

    def slow_pwrite(fd: int, data: Any, offset: int) -> int:
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(0.003)
        with lock:
            live[0] -= 1
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", slow_pwrite)
    with SwapFile(tmp_path / "swap", 16 * 4096, direct=False) as f, AsyncIO(4096, queue_depth, threads) as io:
        io.write(f, 0, torch.zeros(16 * 1024)).wait()
    assert peak[0] == expected


def test_empty_tensor_is_done_at_once(tmp_path: Path) -> None:
    with SwapFile(tmp_path / "swap", 4096) as f, AsyncIO() as io:
        h = io.read(f, 4096, torch.empty(0))
        assert h.done()
        h.wait()


@pytest.mark.parametrize("mode", MODES)
def test_read_after_a_write_waits_for_it_in_the_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       mode: str) -> None:
    """A read into the buffer a slow write is still reading from, issued with ``after=``, returns
    at once to the caller and starts only when the write has ended: the file gets the buffer's old
    bytes, the buffer the file's other bytes (on 4 threads a read that did not wait would overwrite
    the buffer before the write's later chunks read it)."""
    numel = 64 * 1024  # 64 chunks of 4 KiB
    with _swap_file(tmp_path / "swap", 2 * numel * 4, mode) as f, AsyncIO(4096, 8, 4) as io:
        other = aligned_empty(numel, torch.float32).copy_(torch.arange(numel, dtype=torch.float32) + 0.5)
        io.write(f, numel * 4, other).wait()
        real = os.pwrite

        def slow_pwrite(fd: int, data: Any, offset: int) -> int:
            time.sleep(0.002)
            return real(fd, data, offset)

        monkeypatch.setattr(os, "pwrite", slow_pwrite)
        buf = aligned_empty(numel, torch.float32).copy_(-torch.arange(numel, dtype=torch.float32))
        old = buf.clone()
        w = io.write(f, 0, buf)
        r = io.read(f, numel * 4, buf, after=[w])
        assert not r.done()  # queued behind the write, not run by the caller
        r.wait()
        assert w.done()
        w.wait()
        check = aligned_empty(numel, torch.float32)
        io.read(f, 0, check).wait()
    assert torch.equal(check, old), "the read overwrote the buffer while the write was still reading it"
    assert torch.equal(buf, other)


def test_request_after_a_failed_one_still_runs_and_the_error_stays_with_its_handle(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwrite

    def full(*args: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with SwapFile(tmp_path / "swap", 1 << 16, direct=False) as f, AsyncIO(4096, 2, 2) as io:
        src = torch.arange(1024, dtype=torch.float32)
        io.write(f, 4096, src).wait()
        monkeypatch.setattr(os, "pwrite", full)
        w = io.write(f, 0, torch.zeros(1024), what="sub-group 0")
        out = torch.empty(1024)
        r = io.read(f, 4096, out, after=[w, w])  # the same request twice: counted once each
        r.wait()
        monkeypatch.setattr(os, "pwrite", real)
        with pytest.raises(OffloadIOError, match="sub-group 0.*No space left"):
            w.wait()
    assert torch.equal(out, src)


def test_queued_reads_run_before_queued_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One thread, a long write-behind queued first, then a read the training thread waits for: the
    read's chunks run as soon as the chunk in progress ends, not after the write's 15 others."""
    order: list[str] = []
    started, go = threading.Event(), threading.Event()
    real_pwrite, real_preadv = os.pwrite, os.preadv

    def pwrite(fd: int, data: Any, offset: int) -> int:
        order.append("w")
        started.set()
        go.wait(10)  # the first write chunk runs until the read has been queued
        return real_pwrite(fd, data, offset)

    def preadv(fd: int, buffers: Any, offset: int) -> int:
        order.append("r")
        return real_preadv(fd, buffers, offset)

    with SwapFile(tmp_path / "swap", 32 * 4096, direct=False) as f, AsyncIO(4096, 16, 1) as io:
        src = torch.arange(16 * 1024, dtype=torch.float32)
        io.write(f, 16 * 4096, src).wait()
        monkeypatch.setattr(os, "pwrite", pwrite)
        monkeypatch.setattr(os, "preadv", preadv)
        w = io.write(f, 0, torch.ones(16 * 1024))
        assert started.wait(10)
        out = torch.empty(16 * 1024)
        r = io.read(f, 16 * 4096, out)
        go.set()
        r.wait()
        w.wait()
    assert order == ["w"] + ["r"] * 16 + ["w"] * 15, order
    assert torch.equal(out, src)


def test_busy_seconds_count_transfer_time_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Wall time with a transfer running, counted once however many threads transfer together."""
    real = os.pwrite

    def slow_pwrite(fd: int, data: Any, offset: int) -> int:
        time.sleep(0.01)
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", slow_pwrite)
    with SwapFile(tmp_path / "swap", 16 * 4096, direct=False) as f, AsyncIO(4096, 16, 4) as io:
        assert io.busy_seconds == 0.0
        time.sleep(0.05)  # idle: not counted
        start = time.perf_counter()
        io.write(f, 0, torch.zeros(16 * 1024)).wait()  # 16 chunks of 10 ms on 4 threads: about 40 ms
        wall = time.perf_counter() - start
    assert 0.035 <= io.busy_seconds <= wall, (io.busy_seconds, wall)


# --------------------------------------------------------------------------- errors surface at wait()


@pytest.mark.parametrize("mode", MODES)
def test_enospc_on_write_surfaces_at_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    def full(*args: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with _swap_file(tmp_path / "swap", 1 << 20, mode) as f, AsyncIO(block_size=8192, threads=2) as io:
        monkeypatch.setattr(os, "pwrite", full)
        h = io.write(f, 8192, aligned_empty(50_000, torch.float32).zero_(), what="optimizer state exp_avg, sub-group 3")
        with pytest.raises(OffloadIOError) as e:
            h.wait()
        assert h.done()
        assert io.bytes_written == 0
    msg = str(e.value)
    assert str(tmp_path / "swap") in msg and "exp_avg, sub-group 3" in msg and "offset 8192" in msg
    assert "200000 bytes" in msg and "No space left" in msg
    assert e.value.errno == errno.ENOSPC and isinstance(e.value, OSError)
    assert isinstance(e.value.__cause__, OSError)


def test_eio_on_read_surfaces_at_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = [0]
    real = os.preadv

    def flaky(fd: int, buffers: Any, offset: int) -> int:
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset)

    with SwapFile(tmp_path / "swap", 1 << 20, direct=False) as f, AsyncIO(block_size=4096, queue_depth=1) as io:
        monkeypatch.setattr(os, "preadv", flaky)
        h = io.read(f, 0, torch.empty(10 * 1024), what="param shard 7")
        with pytest.raises(OffloadIOError, match=r"read of 40960 bytes at offset 0 .*param shard 7.*Input/output") as e:
            h.wait()
    assert e.value.errno == errno.EIO
    assert calls[0] == 3  # queue depth 1: the request stopped at the failing chunk


@pytest.mark.parametrize("mode", MODES)
def test_short_read_is_an_error_naming_the_file(tmp_path: Path, mode: str) -> None:
    with _swap_file(tmp_path / "swap", 64 * 1024, mode) as f, AsyncIO(block_size=8192) as io:
        os.truncate(f.path, 16 * 1024)  # the file shrank under us
        with pytest.raises(OffloadIOError, match=r"short read.*16384 bytes") as e:
            io.read(f, 4096, torch.empty(8192), what="exp_avg_sq").wait()
    assert str(f.path) in str(e.value) and "exp_avg_sq" in str(e.value)


def test_out_of_range_or_unaligned_requests_are_refused(tmp_path: Path) -> None:
    with SwapFile(tmp_path / "swap", 10_000) as f, AsyncIO() as io:
        with pytest.raises(OffloadIOError, match=r"read of 4000 bytes at offset 8192 of swap file .*swap \(m\).*10000"):
            io.read(f, 8192, torch.empty(1000), what="m")
        with pytest.raises(OffloadIOError, match="multiple of 4096"):
            io.write(f, 100, torch.empty(10))
        with pytest.raises(ValueError, match="contiguous CPU tensor"):
            io.write(f, 0, torch.empty(10, 10).t())
        io.write(f, 0, torch.ones(2500)).wait()  # exactly to the end: fine
    with pytest.raises(OffloadIOError, match="closed"):
        io.write(f, 0, torch.ones(10))


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"block_size": 1000}, "aio.block_size"),
    ({"queue_depth": 0}, "aio.queue_depth"),
    ({"threads": 0}, "aio.intra_op_parallelism"),
])
def test_bad_aio_settings_name_the_key(kwargs: dict[str, int], key: str) -> None:
    with pytest.raises(ConfigError) as e:
        AsyncIO(**kwargs)
    assert e.value.key == key


def test_offload_io_error_pickles() -> None:
    e = OffloadIOError("write of 4 bytes failed", "/nvme/f", errno.EIO)
    back = pickle.loads(pickle.dumps(e))
    assert (str(back), back.path, back.errno) == ("write of 4 bytes failed", "/nvme/f", errno.EIO)


# --------------------------------------------------------------------------- swap files and buffers


def test_aligned_empty() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.uint8):
        for numel in (0, 1, 4097):
            t = aligned_empty(numel, dtype)
            assert (t.dtype, t.shape, t.data_ptr() % 4096) == (dtype, (numel,), 0)
    assert aligned_empty(10, torch.float32, alignment=512).data_ptr() % 512 == 0
    with pytest.raises(ValueError, match="multiple of the element size 4"):
        aligned_empty(10, torch.float32, alignment=6)


def test_swap_file_preallocates_and_refuses_existing(tmp_path: Path) -> None:
    f = SwapFile(tmp_path / "swap", 10_000)
    st = os.stat(f.path)
    assert st.st_size == 12288 and st.st_blocks * 512 >= 12288  # whole blocks, really allocated
    with pytest.raises(OffloadIOError, match="cannot create swap file .*swap"):
        SwapFile(tmp_path / "swap", 10)
    f.close(remove=False)
    assert f.path.exists() and f.closed
    f.close()
    assert not f.path.exists()


def test_full_disk_fails_at_creation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.raises(OffloadIOError, match=r"cannot preallocate 1048576 bytes \(0.00 GiB\) for swap file .*big") as e:
        SwapFile(tmp_path / "big", 1 << 20)
    assert e.value.errno == errno.ENOSPC
    assert not (tmp_path / "big").exists()


# --------------------------------------------------------------------------- check_free_space


KEY = "zero_optimization.offload_optimizer.nvme_path"


def test_check_free_space_missing_and_not_a_directory(tmp_path: Path) -> None:
    check_free_space(tmp_path, 1, KEY)
    check_free_space(tmp_path / "new" / "dir", 1, KEY)  # created with its parents, as DeepSpeed does
    assert (tmp_path / "new" / "dir").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="does not exist and cannot be created") as e:
        check_free_space(tmp_path / "file" / "nope", 1, KEY)
    assert e.value.key == KEY and str(tmp_path / "file" / "nope") in str(e.value)
    with pytest.raises(ConfigError, match=r"file is not a directory"):
        check_free_space(tmp_path / "file", 1, KEY)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_check_free_space_read_only(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    with pytest.raises(ConfigError, match="ro is not writable"):
        check_free_space(ro, 1, KEY)


def test_check_free_space_too_little(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 0, 3 << 29))
    check_free_space(tmp_path, 3 << 29, KEY)
    with pytest.raises(ConfigError) as e:
        check_free_space(tmp_path, 3 << 30, KEY)
    assert e.value.key == KEY
    assert f"{tmp_path} need 3221225472 bytes (3.00 GiB)" in str(e.value)
    assert "has 1610612736 bytes (1.50 GiB) free" in str(e.value)


# --------------------------------------------------------------------------- swap directories


def test_swap_dir_fresh_and_removed(tmp_path: Path) -> None:
    a, b = swap_dir(tmp_path / "nvme", 0), swap_dir(tmp_path / "nvme", 1)
    assert a != b and a.name == "rank0" and b.name == "rank1"
    assert a.parent.name.startswith(f"zeroshard-swap-{_host()}-{os.getpid()}-") and a.parent != b.parent
    SwapFile(a / "f", 100).close(remove=False)
    remove_swap_dir(a)
    remove_swap_dir(b)
    assert list((tmp_path / "nvme").iterdir()) == []


def test_swap_dirs_of_dead_processes_of_this_host_are_removed(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A killed run's swap files (SIGKILL, SIGTERM from torchrun) piled up run after run and filled a
    disk sized for one job; the next run's check removes those of processes that no longer exist."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    gone = int(dead.stdout)
    names = {"stale": f"zeroshard-swap-{_host()}-{gone}-0a0b0c0d",
             "live": f"zeroshard-swap-{_host()}-{os.getpid()}-1",
             "other_host": f"zeroshard-swap-otherhost-{gone}-2", "old_format": f"zeroshard-swap-{gone}-3"}
    for name in names.values():
        (tmp_path / name / "rank0").mkdir(parents=True)
        (tmp_path / name / "rank0" / "master.swp").write_bytes(b"x" * 8192)
    (tmp_path / "checkpoint").mkdir()
    with caplog.at_level("WARNING", logger="zeroshard"):
        check_free_space(tmp_path, 1, KEY)
    left = {p.name for p in tmp_path.iterdir()}
    assert left == set(names.values()) - {names["stale"]} | {"checkpoint"}
    assert names["stale"] in caplog.text and "8192 bytes" in caplog.text


def test_swap_dir_removed_at_clean_exit_and_left_by_a_crash(tmp_path: Path) -> None:
    script = (
        "import os, sys; from pathlib import Path;"
        "from zeroshard.core.offload.aio import SwapFile, swap_dir;"
        "d = swap_dir(Path(sys.argv[1]), 3); SwapFile(d / 'f', 8192);"
        "print(d, flush=True);"
        "os._exit(0) if sys.argv[2] == 'crash' else None"
    )
    for how in ("clean", "crash"):
        out = subprocess.run([sys.executable, "-c", script, str(tmp_path / how), how],
                             capture_output=True, text=True, timeout=120, check=True).stdout
        made = Path(out.strip())
        assert made.parent.parent == tmp_path / how
        assert made.exists() == (how == "crash"), (how, list((tmp_path / how).rglob("*")))
