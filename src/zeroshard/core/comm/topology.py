"""The data-parallel world as a 2-D mesh: nodes × ranks per node.

Built once in ``initialize`` from what torchrun tells every process (``WORLD_SIZE`` and
``LOCAL_WORLD_SIZE``: ranks are numbered node by node, ``rank = node × local + local_rank``) with
torch's :class:`~torch.distributed.device_mesh.DeviceMesh`, whose two dimensions give the process
groups that hierarchical collectives use::

              local 0   local 1
    node 0  [ rank 0,   rank 1 ]   <- "intra" group of rank 0 and 1 (inside the node)
    node 1  [ rank 2,   rank 3 ]
                 ^ "inter" group of ranks 0 and 2 (across nodes, one rank per node)

A run on one node (or one rank per node) has one level: :attr:`Topology.hierarchical` is false,
no group is created, and every collective runs over the data-parallel group exactly as before.

The communication logger reads :func:`level_of` to say which level a collective crossed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zeroshard.errors import ConfigError

__all__ = ["INSIDE", "ACROSS", "WORLD", "Topology", "flat_topology", "level_of", "make_hpz_group", "make_hybrid_groups",
           "make_topology"]

_HPZ_KEY = "zero_optimization.zero_hpz_partition_size"

#: levels a collective's group spans (what the communication logger reports)
INSIDE = "inside nodes"
ACROSS = "across nodes"
WORLD = "world"

_LEVELS: dict[dist.ProcessGroup, str] = {}


@dataclass(frozen=True)
class Topology:
    """This rank's place in the data-parallel world and the groups of each level."""

    nodes: int
    #: ranks per node
    local: int
    #: this rank's node's ranks (``None``: the level has one rank, or the world is one node)
    intra: dist.ProcessGroup | None = None
    #: the ranks of every node with this rank's local index (``None``: one node)
    inter: dist.ProcessGroup | None = None

    @property
    def hierarchical(self) -> bool:
        """Whether there are two levels (several nodes of several ranks)."""
        return self.nodes > 1 and self.local > 1

    @property
    def world(self) -> int:
        """Ranks in the data-parallel world."""
        return self.nodes * self.local


def flat_topology(group: dist.ProcessGroup | None) -> Topology:
    """One node holding every rank of ``group``: no groups of its own."""
    n = _size(group)
    # ``None`` is the world group to torch, but "no group" (one rank) to the quantized collectives
    return Topology(nodes=1, local=n, intra=(group if group is not None else dist.group.WORLD) if n > 1 else None)


def make_topology(group: dist.ProcessGroup | None, device: torch.device) -> Topology:
    """The topology of ``group`` from torchrun's environment.

    ``group`` must be the whole world (``None`` or a group of every rank) for two levels: a
    sub-group's ranks need not sit node by node. Without ``LOCAL_WORLD_SIZE`` (not launched by
    torchrun) or on one node, the topology is flat.

    Raises:
        ConfigError: ``LOCAL_WORLD_SIZE`` does not divide the world size (uneven nodes).
    """
    world = _size(group)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world <= 1 or local >= world or (group is not None and world != dist.get_world_size()):
        return flat_topology(group)
    if local < 1 or world % local:
        raise ConfigError(f"LOCAL_WORLD_SIZE {local} does not divide the world size {world}: every node must "
                          "run the same number of ranks for hierarchical collectives", key="LOCAL_WORLD_SIZE")
    nodes = world // local
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (nodes, local), mesh_dim_names=("node", "local"))
    intra, inter = mesh.get_group("local"), mesh.get_group("node")
    _LEVELS[intra], _LEVELS[inter] = INSIDE, ACROSS
    return Topology(nodes=nodes, local=local, intra=intra if local > 1 else None,
                    inter=inter if nodes > 1 else None)


def make_hpz_group(group: dist.ProcessGroup | None, device: torch.device, size: int) -> dist.ProcessGroup:
    """ZeRO++ hpZ's group of this rank: ``size`` consecutive ranks, inside one node.

    Raises:
        ConfigError: naming ``zero_hpz_partition_size`` and the numbers, when ``size`` does not divide
            the ranks of a node (``LOCAL_WORLD_SIZE``, the whole world without it), or the
            data-parallel group is not the whole world.
    """
    world = _size(group)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if group is not None and world != dist.get_world_size():
        raise ConfigError(f"zero_hpz_partition_size {size} needs the data-parallel group to be the whole world "
                          f"({dist.get_world_size()} ranks), not a group of {world}", key=_HPZ_KEY)
    if size > local or local % size or world % size:
        raise ConfigError(f"zero_hpz_partition_size {size} does not divide the {local} ranks of a node (world size "
                          f"{world}): hpZ's secondary shards live inside a node; use a divisor of {local}",
                          key=_HPZ_KEY)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world // size, size), mesh_dim_names=("hpz_replica", "hpz"))
    hpz = mesh.get_group("hpz")
    _LEVELS[hpz] = INSIDE
    return hpz


_HYBRID_KEY = "zero_optimization.hybrid_shard_size"


def make_hybrid_groups(device: torch.device, shard: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Hybrid sharding over the whole world: ``(sharding group, replicate group)`` of this rank.

    The world is a ``(replicas, shard)`` mesh: groups of ``shard`` consecutive ranks hold one
    sharded copy of the training state each (inside a node when ``shard`` divides the ranks of
    one), and the ranks at the same place in every group form the replicate group, over which
    gradients are all-reduced (FSDP2's HSDP, ``fully_shard(mesh=...)`` on a 2-D mesh).

    Raises:
        ConfigError: naming ``hybrid_shard_size`` and the numbers, when it does not divide the world.
    """
    world = _size(None)
    if shard < 1 or world % shard:
        raise ConfigError(f"hybrid_shard_size {shard} does not divide the world size {world}: the ranks form "
                          f"groups of {shard} that each hold the whole sharded state", key=_HYBRID_KEY)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))
    sharding, replicate = mesh.get_group("shard"), mesh.get_group("replicate")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    _LEVELS[sharding] = INSIDE if local % shard == 0 and local < world else WORLD
    _LEVELS[replicate] = ACROSS if local == shard and local < world else WORLD
    return sharding, replicate


def _size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def level_of(group: dist.ProcessGroup | None) -> str:
    """Which level ``group``'s collectives cross: inside nodes, across nodes, or the world."""
    return _LEVELS.get(group, WORLD) if group is not None else WORLD
