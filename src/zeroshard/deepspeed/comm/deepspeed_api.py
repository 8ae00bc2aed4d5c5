"""``deepspeed.comm`` under DeepSpeed's names and signatures: ``get_rank()``, ``all_reduce(t, group=g)``...

DeepSpeed scripts call ``deepspeed.comm`` (``import deepspeed.comm as dist``) much like
``torch.distributed``, with the group as a keyword. These functions forward to
``torch.distributed`` and, like zeroshard's own collectives (:mod:`.collectives`), are recorded
for failure messages, refused inside a block that some ranks skip (:func:`on_ranks`), and counted
by the communication logger (``comms_logger``). Outside a process group, ranks and sizes are
those of a world of one, as in :func:`zeroshard.core.comm.collectives.rank`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.core.comm.collectives import _begin, _logged, _nbytes
from zeroshard.core.comm.groups import init_distributed as init_distributed

ReduceOp = dist.ReduceOp
ProcessGroup = dist.ProcessGroup

__all__ = [
    "ProcessGroup",
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "destroy_process_group",
    "gather",
    "get_all_ranks_from_group",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_rank_from_launcher",
    "get_world_size",
    "get_world_size_from_launcher",
    "init_distributed",
    "irecv",
    "isend",
    "is_available",
    "is_initialized",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]


def _run(op: str, what: str, tensor: torch.Tensor | None, launch: Callable[[], Any]) -> Any:
    """Start collective ``op`` (DeepSpeed's name; ``what`` for failure messages), logged."""
    _begin(what)
    nbytes = _nbytes(tensor) if tensor is not None else 0
    device = tensor.device if tensor is not None else torch.device("cpu")
    return _logged(op, nbytes, device, launch)


# -- ranks and sizes -----------------------------------------------------------------------------
def is_available() -> bool:
    """Whether ``torch.distributed`` is built in."""
    return bool(dist.is_available())


def is_initialized() -> bool:
    """Whether a process group exists."""
    return bool(dist.is_initialized())


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (1 without a process group)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    """The launcher's ``LOCAL_RANK`` (0 without one)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_world_rank_from_launcher() -> int:
    """The launcher's ``RANK`` (0 without one)."""
    return int(os.environ.get("RANK", "0"))


def get_world_size_from_launcher() -> int:
    """The launcher's ``WORLD_SIZE`` (1 without one)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def get_global_rank(group: ProcessGroup | None = None, group_rank: int = 0) -> int:
    """The global rank of ``group``'s rank ``group_rank``."""
    if group is None or not dist.is_initialized():
        return group_rank
    return int(dist.get_global_rank(group, group_rank))


def get_all_ranks_from_group(group: ProcessGroup | None = None) -> list[int]:
    """The global ranks of ``group``, in group order."""
    return [get_global_rank(group, r) for r in range(get_world_size(group))]


def new_group(ranks: list[int]) -> ProcessGroup:
    """A process group over ``ranks`` (collective over the world, as in torch)."""
    return dist.new_group(ranks)


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Destroy ``group`` (the default group when None)."""
    dist.destroy_process_group(group)


# -- collectives ---------------------------------------------------------------------------------
def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None,
               async_op: bool = False) -> Any:
    """In-place reduction of ``tensor`` over ``group``."""
    return _run("all_reduce", "all-reduce", tensor, lambda: dist.all_reduce(tensor, op=op, group=group,
                                                                            async_op=async_op))


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None,
           async_op: bool = False) -> Any:
    """Reduce ``tensor`` into global rank ``dst``."""
    return _run("reduce", "reduce", tensor, lambda: dist.reduce(tensor, dst, op=op, group=group, async_op=async_op))


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Broadcast ``tensor`` from global rank ``src``."""
    return _run("broadcast", "broadcast", tensor, lambda: dist.broadcast(tensor, src, group=group,
                                                                         async_op=async_op))


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup | None = None,
               async_op: bool = False) -> Any:
    """Every rank's ``tensor`` into ``tensor_list``."""
    return _run("all_gather", "all-gather", tensor, lambda: dist.all_gather(tensor_list, tensor, group=group,
                                                                            async_op=async_op))


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                           group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Every rank's ``input_tensor``, concatenated into ``output_tensor``."""
    return _run("all_gather_into_tensor", "all-gather", output_tensor, lambda: dist.all_gather_into_tensor(
        output_tensor, input_tensor, group=group, async_op=async_op))


def reduce_scatter_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Reduce ``input_tensor`` over ranks and keep this rank's chunk in ``output_tensor``."""
    return _run("reduce_scatter_tensor", "reduce-scatter", input_tensor, lambda: dist.reduce_scatter_tensor(
        output_tensor, input_tensor, op=op, group=group, async_op=async_op))


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: ProcessGroup | None = None,
                      async_op: bool = False) -> Any:
    """All-to-all of one tensor's chunks."""
    return _run("all_to_all_single", "all-to-all", tensor, lambda: dist.all_to_all_single(
        output, tensor, output_split_sizes, input_split_sizes, group=group, async_op=async_op))


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,
           group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Every rank's ``tensor`` into ``gather_list`` on global rank ``dst``."""
    return _run("gather", "gather", tensor, lambda: dist.gather(tensor, gather_list, dst, group=group,
                                                                async_op=async_op))


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0,
            group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Rank ``src``'s ``scatter_list[r]`` into rank r's ``tensor``."""
    return _run("scatter", "scatter", tensor, lambda: dist.scatter(tensor, scatter_list, src, group=group,
                                                                   async_op=async_op))


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> None:
    """Blocking send to global rank ``dst``."""
    _run("send", "send", tensor, lambda: dist.send(tensor, dst, group=group, tag=tag))


def recv(tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0) -> Any:
    """Blocking receive from global rank ``src``."""
    return _run("recv", "recv", tensor, lambda: dist.recv(tensor, src, group=group, tag=tag))


def isend(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> Any:
    """Non-blocking send; returns the request."""
    return _run("isend", "send", tensor, lambda: dist.isend(tensor, dst, group=group, tag=tag))


def irecv(tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0) -> Any:
    """Non-blocking receive; returns the request."""
    return _run("irecv", "recv", tensor, lambda: dist.irecv(tensor, src, group=group, tag=tag))


def barrier(group: ProcessGroup | None = None, async_op: bool = False, device_ids: list[int] | None = None) -> Any:
    """Block until every rank of ``group`` arrives (a no-op without a process group)."""
    if not dist.is_initialized():
        return None
    return _run("barrier", "barrier", None, lambda: dist.barrier(group=group, async_op=async_op,
                                                                 device_ids=device_ids))


def monitored_barrier(group: ProcessGroup | None = None, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
    """A barrier that names the ranks that did not arrive (gloo)."""
    return _run("monitored_barrier", "barrier", None, lambda: dist.monitored_barrier(
        group=group, timeout=timeout, wait_all_ranks=wait_all_ranks))
