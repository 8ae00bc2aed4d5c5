"""A torchrun script for ``tests/distributed/test_emulated_cluster.py``, run on every node of an
:class:`emulated_cluster.EmulatedCluster`; every rank writes ``<out>/rank<R>.json``.

``smoke``: an all_reduce of a known tensor over the world, an all_reduce of a large tensor within
each node only (a ``new_group`` of the node's ranks), and one large ``send`` from rank 0 to the
first rank of node 1. Every phase is bracketed ``barrier, read the link counters, phase, barrier,
read``, so a reading includes all the phase's traffic (a rank leaves the second barrier only after
every rank finished the phase) plus two barriers' worth; an ``empty`` phase measures that worth.
Each rank reads its own node's veth counters (``/sys/class/net`` in the namespace is the node's).

``hang``: world all_reduces in a loop until one fails (the test cuts the link), then the rank writes
``failed.rank<R>`` with the error and raises it; with the gloo timeout ``--timeout``.

Every rank touches ``<out>/probe.rank<R>.done`` last, after ``destroy_process_group``
(:func:`teardown.done_markers` of ``<out>/probe``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import zeroshard


def counters() -> dict[str, int]:
    iface = os.environ["GLOO_SOCKET_IFNAME"]
    stats = Path("/sys/class/net") / iface / "statistics"
    return {k: int((stats / f"{k}_bytes").read_text()) for k in ("tx", "rx")}


def phase(name: str, results: dict, fn) -> None:
    dist.barrier()
    before, t0 = counters(), time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    dist.barrier()
    after = counters()
    results[name] = {"seconds": seconds, **{k: after[k] - before[k] for k in before}}


def smoke(args: argparse.Namespace, rank: int, world: int) -> dict:
    node, local = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])
    nodes: list[int] = [0] * world
    dist.all_gather_object(nodes, node)
    groups = {n: dist.new_group([r for r in range(world) if nodes[r] == n]) for n in sorted(set(nodes))}
    results: dict = {"rank": rank, "node": node, "local_rank": local, "world": world, "nodes": nodes,
                     "zeroshard": zeroshard.__file__, "phases": {}}
    phases = results["phases"]

    phase("empty", phases, lambda: None)

    known = torch.arange(args.world_numel, dtype=torch.float32) * (rank + 1)
    phase("world", phases, lambda: dist.all_reduce(known))
    expected = torch.arange(args.world_numel, dtype=torch.float32) * (world * (world + 1) // 2)
    results["world_ok"] = torch.equal(known, expected)

    big = torch.full((args.node_numel,), float(rank + 1))
    phase("node", phases, lambda: dist.all_reduce(big, group=groups[node]))
    node_sum = sum(r + 1 for r in range(world) if nodes[r] == node)
    results["node_ok"] = torch.equal(big, torch.full_like(big, float(node_sum)))

    receiver = nodes.index(1)
    payload = torch.full((args.push_numel,), float(rank))
    if rank == 0:
        phase("push", phases, lambda: dist.send(payload, dst=receiver))
    elif rank == receiver:
        phase("push", phases, lambda: dist.recv(payload, src=0))
        results["push_ok"] = torch.equal(payload, torch.zeros_like(payload))
    else:
        phase("push", phases, lambda: None)
    return results


def hang(args: argparse.Namespace, rank: int, world: int) -> dict:
    x = torch.ones(args.world_numel)
    (Path(args.out) / f"ready.rank{rank}").touch()
    deadline = time.monotonic() + args.hang_s
    rounds = 0
    try:
        while True:
            x.fill_(1.0)
            x[0] = float(time.monotonic() > deadline)  # stop together: in the round where any rank is late
            dist.all_reduce(x)
            rounds += 1
            if x[0] > 0:
                break
    except Exception as e:  # any failure is what the test waits for
        (Path(args.out) / f"failed.rank{rank}").write_text(f"after {rounds} rounds: {type(e).__name__}: {e}")
        raise
    return {"rank": rank, "rounds": rounds, "failed": False}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("smoke", "hang"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=60.0, help="the process group's timeout, seconds")
    ap.add_argument("--world-numel", type=int, default=256 * 1024)
    ap.add_argument("--node-numel", type=int, default=2 * 1024 * 1024)
    ap.add_argument("--push-numel", type=int, default=2 * 1024 * 1024)
    ap.add_argument("--hang-s", type=float, default=120.0, help="hang: stop after this long if nothing failed")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    results = (smoke if args.mode == "smoke" else hang)(args, rank, world)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    (Path(args.out) / f"probe.rank{rank}.done").touch()


if __name__ == "__main__":
    main()
