"""The emulated two-node cluster (``tests/emulated_cluster.py``): two network namespaces joined by a
tbf-throttled veth, torchrun on each, gloo across.

* Smoke (2 nodes x 2 ranks, link at 100mbit, ``tests/cluster_probe.py smoke``): a world all_reduce of
  a known tensor and an all_reduce of 8 MiB within each node are right; the node-local one puts no
  more on the link than two barriers do, the world one at least the tensor in each direction (each
  node's half of the sum must reach the other, whatever gloo's algorithm); 8 MiB sent across takes
  at least 0.5 s (0.67 s at 100 Mbit/s), so the throttle holds. A check of the fixture, not a timing
  of zeroshard.
* Leaving the cluster, by an exception or Ctrl-C, leaves no namespace and no process of it, including
  processes that left their process group; ``kill_node`` kills a whole node and only it;
  ``cleanup_stale`` removes what a dead run left.
* Cutting the link during world all_reduces makes every rank fail at gloo's timeout (10 s here), both
  torchruns exit non-zero within 60 s of the cut, and nothing is left.

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from emulated_cluster import (
    SRC,
    EmulatedCluster,
    available,
    cleanup_stale,
    cluster_fixture,
    start_torchrun,
    torchrun_cluster,
)
from teardown import died_in_teardown, done_markers

PROBE = Path(__file__).resolve().parents[1] / "cluster_probe.py"
PREFIX = "zstest"
MIB = 1024 * 1024
WORLD_BYTES = 1 * MIB  # the world all_reduce's tensor (float32)
NODE_BYTES = 8 * MIB   # the node-local all_reduce's
PUSH_BYTES = 8 * MIB   # sent from rank 0 to node 1

_ok, _why = available()
pytestmark = pytest.mark.skipif(not _ok, reason=_why or "emulated cluster available")

cluster_100mbit = cluster_fixture("100mbit", prefix=PREFIX)


def _inode(ns: str) -> int:
    return os.stat(f"/run/netns/{ns}").st_ino


def _pids_in(inodes: set[int]) -> list[int]:
    """Processes whose network namespace is one of ``inodes``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.stat(entry / "ns" / "net").st_ino in inodes:
                    pids.append(int(entry.name))
            except OSError:  # gone, or a zombie (whose namespaces are released)
                pass
    return pids


def _our_namespaces(cluster: EmulatedCluster) -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split()
    return [n for n in names if n in cluster.namespaces or n == cluster.hub]


def _assert_nothing_left(cluster: EmulatedCluster, inodes: set[int], pids: list[int]) -> None:
    assert _our_namespaces(cluster) == []
    assert _pids_in(inodes) == []
    for pid in pids:  # neither running nor an unreaped child of ours
        assert not Path(f"/proc/{pid}").exists(), f"process {pid} of the cluster is still there"


def test_smoke_two_nodes(cluster_100mbit: EmulatedCluster, tmp_path: Path) -> None:
    cluster = cluster_100mbit
    run = torchrun_cluster(cluster, PROBE, ["smoke", "--out", str(tmp_path), "--world-numel", str(WORLD_BYTES // 4),
                                            "--node-numel", str(NODE_BYTES // 4), "--push-numel",
                                            str(PUSH_BYTES // 4)], nproc_per_node=2, timeout=180)
    if not run.ok:
        log = run.describe()
        assert not run.timed_out and died_in_teardown("cluster smoke", log, done_markers(tmp_path / "probe", 4)), log
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r in ranks:
        assert r["world_ok"] and r["node_ok"], r
        assert Path(r["zeroshard"]).resolve().is_relative_to(SRC.resolve()), r["zeroshard"]
        assert r["nodes"] == [0, 0, 1, 1]
    assert ranks[2]["push_ok"]

    for leader in (ranks[0], ranks[2]):  # local rank 0 of each node reads its node's veth
        p = leader["phases"]
        bracket = p["empty"]["tx"] + p["empty"]["rx"]  # two barriers
        # Node-local: no more on the link than the bracket's barriers (a few KiB), far below 8 MiB.
        assert p["node"]["tx"] + p["node"]["rx"] <= bracket + 32 * 1024, p
        # World: each node's contribution to the sum must reach the other node (gloo's ring sends
        # 1.5x the tensor each way here; any algorithm at least 1x).
        assert p["world"]["tx"] >= WORLD_BYTES and p["world"]["rx"] >= WORLD_BYTES, p
    # The launcher's own counters agree: node 0 sent the world share and the push, node 1 the world share.
    assert run.link_delta[0] >= WORLD_BYTES + PUSH_BYTES and run.link_delta[1] >= WORLD_BYTES, run.link_delta

    # The throttle: 8 MiB at 100 Mbit/s is 0.67 s; unthrottled it took ~10 ms here.
    push = ranks[2]["phases"]["push"]
    assert push["rx"] >= PUSH_BYTES
    assert 0.5 <= push["seconds"] < 60, push


def test_exit_leaves_nothing(tmp_path: Path) -> None:
    sleep = ["sleep", "300"]
    for stop in (RuntimeError, KeyboardInterrupt):
        cluster = EmulatedCluster(rate="1gbit", prefix=PREFIX)
        with pytest.raises(stop), cluster:
            inodes = {_inode(ns) for ns in cluster.namespaces}
            pids = [cluster.run(n, sleep).pid for n in (0, 1)]
            # One that leaves its process group and session: found by its namespace.
            cluster.run(1, ["setsid", "--fork", *sleep]).wait(timeout=10)
            deadline = time.monotonic() + 10
            while len(_pids_in({_inode(cluster.namespaces[1])})) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(_pids_in({_inode(cluster.namespaces[1])})) == 2
            cluster.kill_node(1)
            assert _pids_in({_inode(cluster.namespaces[1])}) == []
            assert _pids_in({_inode(cluster.namespaces[0])}) == [pids[0]]
            cluster.run(0, ["setsid", "--fork", *sleep]).wait(timeout=10)
            raise stop("leaving the cluster by an exception")
        _assert_nothing_left(cluster, inodes, pids)

    # What a run killed before cleaning up leaves: a namespace named after a dead pid, a process in it.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"{PREFIX}-{dead.pid}-0n0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    inode = _inode(stale)
    subprocess.Popen(["ip", "netns", "exec", stale, "setsid", "--fork", *sleep]).wait(timeout=10)
    assert cleanup_stale(PREFIX) == [stale]
    assert _pids_in({inode}) == []
    assert stale not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_link_down_fails_ranks(tmp_path: Path) -> None:
    cluster = EmulatedCluster(rate="1gbit", prefix=PREFIX)
    with cluster:
        inodes = {_inode(ns) for ns in cluster.namespaces}
        job = start_torchrun(cluster, PROBE, ["hang", "--out", str(tmp_path), "--timeout", "10"])
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("ready.rank*"))) < 4:
            assert time.monotonic() < deadline and all(p.poll() is None for p in job.procs), \
                job.wait(0).describe()
            time.sleep(0.1)
        time.sleep(0.5)  # all_reduces running across the link
        cluster.set_link(False)
        cut = time.monotonic()
        run = job.wait(timeout=cut - job.started + 60)
        ended = time.monotonic() - cut
        assert not run.timed_out, run.describe()
        assert all(n.returncode not in (0, None) for n in run.nodes), run.describe()
        failures = {r: (tmp_path / f"failed.rank{r}") for r in range(4)}
        assert all(f.exists() for f in failures.values()), run.describe()
        assert any("Timed out" in f.read_text() or "Connection" in f.read_text() for f in failures.values())
        assert ended < 60
        pids = [p.pid for p in job.procs]
    _assert_nothing_left(cluster, inodes, pids)


cluster_1gbit = cluster_fixture("1gbit", prefix=PREFIX)
TRAIN = Path(__file__).resolve().parents[1] / "cluster_train.py"


def test_zeropp_quantization_cuts_the_bytes_on_the_link(cluster_1gbit: EmulatedCluster, tmp_path: Path) -> None:
    """ZeRO stage 3 on 2 nodes x 2 ranks, fp32, 4 steps, units released after forward: with qwZ, qgZ
    and hpZ the bytes that really cross the veth (its counters, both directions) are at most 0.3x
    the plain run's (the issue's goal for the three together), and the comms logger saw collectives
    at both levels. Without hpZ (an earlier version of this test, every unit kept through backward)
    it was 0.303x: the int8 all-gathers crossed twice a step; hpZ keeps the backward one inside."""
    sent = {}
    for mode in ("plain", "quantized"):
        out = tmp_path / mode
        out.mkdir()
        run = torchrun_cluster(cluster_1gbit, TRAIN, ["--out", str(out)] + (["--quantized"] if mode != "plain" else []),
                               nproc_per_node=2, timeout=300)
        if not run.ok:
            log = run.describe()
            assert not run.timed_out and (out / "train.json").exists() and died_in_teardown(mode, log), log
        sent[mode] = (sum(run.link_delta), json.loads((out / "train.json").read_text()))
    ratio = sent["quantized"][0] / sent["plain"][0]
    print(f"bytes on the link: plain {sent['plain'][0]}, quantized {sent['quantized'][0]} ({ratio:.3f}x); "
          f"logger levels {sent['quantized'][1]['levels']}")
    assert ratio <= 0.3, sent
    levels = sent["quantized"][1]["levels"]
    assert levels.get("across nodes", 0) > 0 and levels.get("inside nodes", 0) > 0, levels
