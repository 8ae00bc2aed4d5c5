"""Run by torchrun for ``tests/distributed/test_cluster_faults.py``: ring reduce-scatters of 64 MiB
chunks (zeroshard's point-to-point ring, ``collectives.reduce_scatter_rows``) over the emulated
two-node cluster, one after another, with the process group's default timeout (10 minutes).

Every rank touches ``<out>/ring.rank<R>`` once its first ring is under way; the test then kills node
1. Over the 1gbit link a hop across nodes takes about 0.5 s, so the kill lands with messages half
transferred: node 0's receives (and sends) from node 1 had begun, and gloo wakes neither when the
connection closes. A rank whose ring fails writes ``<out>/error.rank<R>.json`` (``time.time()``, the
error's type and message) and exits 1.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from zeroshard.core.comm import collectives as C
from zeroshard.core.comm import watchdog


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torch's default timeout for gloo: 30 minutes
    watchdog.start_heartbeat()
    world = dist.get_world_size()
    buf = torch.ones(world * 16 * 2**20)
    C.barrier(None)
    time.sleep(2 * watchdog.HEARTBEAT_S + 0.5)  # every rank's heartbeat seen moving
    try:
        for i in range(1000):
            pending = C.reduce_scatter_rows(buf, None, tag=0)
            if i == 0:
                (out / f"ring.rank{rank}").touch()
            pending.wait()
    except Exception as failure:
        # as the engine's calls do (watchdog.guarded): a failed collective named with the peers' state
        e = watchdog.explain(failure) if watchdog.is_backend_failure(failure) else failure
        (out / f"error.rank{rank}.json").write_text(json.dumps(
            {"time": time.time(), "type": type(e).__name__, "message": str(e)}))
        sys.stderr.write(f"{e}\n")
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    main()
