"""How a failed collective's error names the lost peers (``zeroshard.core.comm.watchdog``), without a
cluster: the ranks with their nodes (torchrun's ``rank = node x LOCAL_WORLD_SIZE + local rank``),
and, when the rendezvous store does not answer, its address, what connecting to it gives and the
ranks on other nodes. ``tests/distributed/test_cluster_faults.py`` checks the same on the emulated
two-node cluster with a killed node and a cut link."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from zeroshard.core.comm import watchdog


@pytest.fixture
def rank2_of_4(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 2 of 4, two per node, as torchrun numbers them."""
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(watchdog, "_store_silent", False)


def test_ranks_are_named_with_their_nodes(rank2_of_4: None, monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = watchdog._node_of()
    assert nodes == {0: 0, 1: 0, 2: 1, 3: 1}
    assert watchdog._ranks([2, 3], nodes) == "ranks 2, 3 (all of node 1)"
    assert watchdog._ranks([1, 2, 3], nodes) == "ranks 1, 2, 3 (node 0; all of node 1)"
    assert watchdog._ranks([0], None) == "rank 0"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # uneven nodes: not named
    assert watchdog._node_of() is None


@pytest.mark.parametrize("listening", [True, False], ids=["stopped store", "no store"])
def test_a_silent_store_names_the_ranks_of_other_nodes(rank2_of_4: None, monkeypatch: pytest.MonkeyPatch,
                                                        listening: bool) -> None:
    if listening:  # a store that accepts connections (its host process stopped would, too)
        server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
        port = server.port
        monkeypatch.setattr(watchdog, "_store", dist.PrefixStore("default_pg", server))
    else:  # a port where nothing listens: connecting is refused
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        monkeypatch.setattr(watchdog, "_store_address", lambda: ("127.0.0.1", port))
    lines = watchdog._silent_store(5.0)
    assert lines[0].startswith("lost peers: ranks 0, 1 (all of node 0), every rank on another node: "
                               f"the rendezvous store at 127.0.0.1:{port} does not answer (waited 5 s)")
    assert ("although it accepts connections" if listening else "Connection refused") in lines[0]
    assert lines[1] == "this node runs ranks 2, 3"
    assert watchdog._store_silent  # exiting then does not wait for the heartbeat stuck behind the store
