"""How fast does the NVMe offload engine read and write swap files on a directory's disk?

    python benchmarks/studies/disk_bandwidth.py [--dir /tmp] [--gib 1] [--threads 1,2,4] [--block-mib 1,8]

Writes ``--gib`` GiB from one aligned host buffer into one swap file as a single request
(``zeroshard.core.offload.aio.AsyncIO``, queue depth 8), then reads it back, for each mode (``O_DIRECT``
and buffered), thread count and block size, and prints a markdown table of GiB/s. The write time
includes an ``fsync``, so buffered writes are timed to the disk, not to the page cache; before each
read the file's pages are dropped from the page cache (``posix_fadvise(DONTNEED)``), so buffered reads
come from the disk too. A sample of the data read back is checked against what was written.

``measure(directory, nbytes, threads, block_size)`` returns ``(read, write)`` GiB/s, for other
benchmarks that bound a step's time by its swap traffic.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from zeroshard.core.offload.aio import AsyncIO, SwapFile, aligned_empty, check_free_space, remove_swap_dir, swap_dir

_GIB = float(1 << 30)
_MODES = {"O_DIRECT": True, "buffered": False}


def _run(directory: Path, nbytes: int, threads: int, block_size: int, direct: bool | None) -> tuple[float, float, bool]:
    """Write then read ``nbytes`` once; return (read GiB/s, write GiB/s, whether O_DIRECT was used)."""
    nbytes = -(-nbytes // block_size) * block_size
    check_free_space(directory, nbytes, "--dir")
    buf = aligned_empty(nbytes, torch.uint8)
    buf.view(torch.int32).random_()
    sample = buf[:: 1 << 16].clone()
    where = swap_dir(directory, 0)
    try:
        with SwapFile(where / "bench", nbytes, direct=direct) as f, AsyncIO(block_size, 8, threads) as io:
            start = time.perf_counter()
            io.write(f, 0, buf).wait()
            os.fsync(f.fileno())
            write_s = time.perf_counter() - start
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            buf.zero_()
            start = time.perf_counter()
            io.read(f, 0, buf).wait()
            read_s = time.perf_counter() - start
            used_direct = f.direct
    finally:
        remove_swap_dir(where)
    if not torch.equal(buf[:: 1 << 16], sample):
        raise RuntimeError(f"disk_bandwidth: the data read back from {directory} differs from what was written")
    return nbytes / _GIB / read_s, nbytes / _GIB / write_s, used_direct


def measure(directory: Path, nbytes: int, threads: int, block_size: int) -> tuple[float, float]:
    """Sequential (read, write) GiB/s of the offload engine on ``directory``, with O_DIRECT where supported.

    Args:
        directory: an existing, writable directory on the disk to measure (the ``nvme_path``).
        nbytes: bytes to write and read back (rounded up to a whole block).
        threads: worker threads (``aio.intra_op_parallelism``).
        block_size: bytes per chunk (``aio.block_size``), a multiple of 4096.
    """
    read, write, _ = _run(Path(directory), nbytes, threads, block_size, None)
    return read, write


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=Path("/tmp"), help="directory on the disk to measure")
    p.add_argument("--gib", type=float, default=1.0, help="GiB written and read per configuration")
    p.add_argument("--threads", default="1,2,4", help="comma-separated thread counts")
    p.add_argument("--block-mib", default="1,8", help="comma-separated block sizes in MiB")
    args = p.parse_args(argv)
    nbytes = int(args.gib * _GIB)
    print(f"{args.gib:g} GiB per run on {args.dir} ({os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}); write time includes fsync; page cache dropped before each read\n")
    print("| mode | threads | block | write GiB/s | read GiB/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for mode, direct in _MODES.items():
        for threads in (int(t) for t in args.threads.split(",")):
            for mib in (int(b) for b in args.block_mib.split(",")):
                try:
                    read, write, used = _run(args.dir, nbytes, threads, mib << 20, direct)
                except OSError as e:  # O_DIRECT refused by this filesystem: say so, measure the rest
                    print(f"| {mode} | {threads} | {mib} MiB | {e} | |")
                    continue
                label = mode if used == direct else f"{mode} (ran {'O_DIRECT' if used else 'buffered'})"
                print(f"| {label} | {threads} | {mib} MiB | {write:.2f} | {read:.2f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
