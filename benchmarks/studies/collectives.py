"""How fast are the collectives the stages use, on this machine's backend? (2 ranks by default)

    python benchmarks/studies/collectives.py [--mib 25] [--iters 10] [--world-size 2]

Times ``all_reduce``, ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` of one fp32 bucket
(the same payload: the full bucket in, the full bucket out), and a plain ``clone`` of it, median over
``--iters``. On gloo, ``reduce_scatter_tensor`` is not a native reduce-scatter: compare it with
``all_reduce`` + ``clone`` to see what a ZeRO stage pays for it.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time


def _rank(rank: int, world: int, port: int, mib: int, iters: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    n = mib * 2**20 // 4 // world * world
    full = torch.randn(n)
    shard = torch.empty(n // world)
    # torch 2.13 renamed the flat collectives; older releases only have the *_tensor names.
    reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    mine = slice(rank * shard.numel(), (rank + 1) * shard.numel())
    recv = torch.empty(n // world)

    def ring_reduce_scatter() -> None:
        # world - 1 point-to-point steps; rank r ends holding chunk r summed (half an all-reduce).
        chunks = full.view(world, -1)
        for s in range(world - 1):
            send_i, recv_i = (rank - s - 1) % world, (rank - s - 2) % world
            works = [dist.isend(chunks[send_i], (rank + 1) % world), dist.irecv(recv, (rank - 1) % world)]
            for w in works:
                w.wait()
            chunks[recv_i].add_(recv)

    def ring_all_gather() -> None:
        # world - 1 point-to-point steps, each forwarding the chunk received in the step before.
        chunks = full.view(world, -1)
        chunks[rank].copy_(shard)
        for s in range(world - 1):
            send_i, recv_i = (rank - s) % world, (rank - s - 1) % world
            works = [dist.isend(chunks[send_i], (rank + 1) % world), dist.irecv(chunks[recv_i], (rank - 1) % world)]
            for w in works:
                w.wait()

    ops = {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter": lambda: reduce_scatter(shard, full),
        "all_reduce + own chunk": lambda: (dist.all_reduce(full), shard.copy_(full[mine])),
        "ring reduce-scatter (p2p)": ring_reduce_scatter,
        "all_gather": lambda: all_gather(full, shard),
        "ring all-gather (p2p)": ring_all_gather,
        "clone (local)": lambda: full.clone(),
    }
    for name, op in ops.items():
        times = []
        for _ in range(iters + 2):
            dist.barrier()
            t = time.perf_counter()
            op()
            times.append(time.perf_counter() - t)
        med = statistics.median(times[2:])
        if rank == 0:
            print(f"{name:24s} {mib} MiB: {med * 1e3:7.1f} ms  ({mib / 1024 / med:.2f} GiB/s of bucket)", flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Spawn the ranks and print rank 0's timings."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=25, help="bucket size in MiB of fp32")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--world-size", type=int, default=2)
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(args.world_size, port, args.mib, args.iters), nprocs=args.world_size,
                       start_method="spawn", join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
