"""The communication logger (``comms_logger``): count, bytes, latency and bandwidth per collective.

Every collective in :mod:`zeroshard.core.comm.collectives` passes through one hook (``HOOK``); while a
:class:`CommsLogger` is installed there it times each collective and files it under DeepSpeed's
op name (``all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``broadcast``,
``barrier``) and message size. :meth:`CommsLogger.summary` prints DeepSpeed's table
(``deepspeed.comm.log_summary()``: op, message size, count, total and mean latency, algorithm
and bus bandwidth) on rank 0 and returns DeepSpeed's dictionary; the engine exposes it as
``engine.comms_summary()``, and at exit rank 0 prints what was never summarised.

How latency is measured: as DeepSpeed does, a logged collective is made blocking. The logger
synchronises the device, starts the collective, waits for it (and synchronises again on an
accelerator), so the latency is launch to completion of that collective alone. The price is that
asynchronous collectives no longer overlap with computation while the logger is on (the
alternative, launch to the caller's ``wait()``, would count the overlapped computation as
communication). ``benchmarks/studies/comms_logger_cost.py`` measures the cost.

Sizes and bandwidth follow nccl-tests (``PERFORMANCE.md``): the message size is the whole
buffer (the gathered output of an all-gather, the unreduced input of a reduce-scatter, the
tensor of an all-reduce or broadcast), algorithm bandwidth is size / time, and bus bandwidth
multiplies it by ``2(n-1)/n`` for all-reduce, ``(n-1)/n`` for all-gather and reduce-scatter, 1
for the rest. Bus bandwidths equal DeepSpeed's (``deepspeed/utils/comms_logging.py``); DeepSpeed's
``tput`` differs for all-reduce (it counts 2 x size) and reduce-scatter (it multiplies the
already whole input by n again), and it files an all-gather under the per-rank input size.
Averages are over the latest :data:`WINDOW` calls of each (op, size), 10% trimmed at each end as
DeepSpeed's; the count and the total latency cover every call.
"""

from __future__ import annotations

import atexit
import logging
import math
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import torch

from zeroshard.core.comm import collectives as C
from zeroshard.core.comm.topology import WORLD
from zeroshard.core.device import synchronize
from zeroshard.errors import ConfigError, NotYetSupportedError

logger = logging.getLogger("zeroshard")

#: DeepSpeed's op names: those of zeroshard's collectives (the first five) and of ``zeroshard.deepspeed.comm``'s
#: DeepSpeed API; the names ``prof_ops`` accepts
OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "barrier", "all_gather",
       "all_to_all_single", "reduce", "gather", "scatter", "send", "recv", "isend", "irecv", "monitored_barrier")
#: DeepSpeed's other names for some of them (its wrappers' names)
ALIASES = {"allgather_fn": "all_gather_into_tensor", "reduce_scatter_fn": "reduce_scatter_tensor",
           "inference_all_reduce": "all_reduce"}
#: latencies kept per (op, size) for the trimmed means: bounded, so a long run's memory is too
WINDOW = 1024
_COLUMNS = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)",
            "busbw_avg (Gbps)")

_W = TypeVar("_W")


def bus_factor(op: str, world: int) -> float:
    """nccl-tests' factor from algorithm to bus bandwidth for ``op`` on ``world`` ranks."""
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in ("all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "all_to_all_single"):
        return (world - 1) / world
    return 1.0


def convert_size(size: int) -> str:
    """``1.5 KB``: DeepSpeed's human-readable message size (powers of 1024)."""
    if size == 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB")
    i = min(int(math.floor(math.log(size, 1024))), len(names) - 1)
    return f"{round(size / 1024**i, 2)} {names[i]}"


def trim_mean(values: list[float], fraction: float = 0.1) -> float:
    """Mean of ``values`` without the ``fraction`` smallest and largest (DeepSpeed's ``trim_mean``)."""
    if not values:
        return 0.0
    data = sorted(values)
    k = int(round(len(data) * fraction))
    kept = data[k : len(data) - k] or data
    return sum(kept) / len(kept)


@dataclass
class OpRecord:
    """Calls of one op with one message size."""

    count: int = 0
    total_s: float = 0.0
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.latencies.append(seconds)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes * 8 / seconds / 1e9 if seconds > 0 else 0.0


def resolve_ops(names: list[str]) -> set[str]:
    """``comms_logger.prof_ops`` as zeroshard's op names; an unknown name is a :class:`ConfigError`."""
    out = set()
    for name in names:
        op = ALIASES.get(name, name)
        if op not in OPS:
            raise ConfigError(f"unknown collective {name!r}; zeroshard's collectives are {', '.join(OPS)} "
                              f"(also accepted: {', '.join(sorted(ALIASES))})", key="comms_logger.prof_ops")
        out.add(op)
    return out


class CommsLogger:
    """Times and counts the collectives of this process while installed (:meth:`install`).

    Args:
        cfg: the ``comms_logger`` config block (``enabled``, ``verbose``, ``prof_all``, ``prof_ops``,
            ``debug``).
        rank: this process's global rank (rank 0 prints).
        world: ranks in the group the collectives run on (for the bus bandwidth).
    """

    def __init__(self, cfg: Any, rank: int, world: int) -> None:
        self.verbose = bool(cfg.verbose)
        self.debug = bool(cfg.debug)
        self.prof_all = bool(cfg.prof_all)
        self.prof_ops = resolve_ops(list(cfg.prof_ops))
        self.rank, self.world = rank, world
        #: op name (with the caller under ``debug``) -> message bytes -> calls
        self.records: dict[str, dict[int, OpRecord]] = {}
        #: bytes of every collective logged, by the level it crossed (:mod:`zeroshard.core.comm.topology`)
        self.bytes_by_level: dict[str, int] = {}
        self._unreported = False

    # -- the hook ------------------------------------------------------------------------------
    def install(self) -> CommsLogger:
        """Start logging this process's collectives (replacing any other logger)."""
        C.HOOK.recorder = self
        _register_exit_summary()
        return self

    def uninstall(self) -> None:
        """Stop logging (the records stay)."""
        if C.HOOK.recorder is self:
            C.HOOK.recorder = None

    def wants(self, op: str) -> bool:
        """Whether ``op`` is profiled (``prof_all``, else listed in ``prof_ops``)."""
        return self.prof_all or op in self.prof_ops

    def run(self, op: str, nbytes: int, device: torch.device, launch: Callable[[], _W], level: str = WORLD) -> _W:
        """Start a collective with ``launch``, wait for it, and record its latency. A collective
        over one level of a two-level world (inside nodes, across nodes) is filed as
        ``"<op> | <level>"``, and its bytes are added to :attr:`bytes_by_level`."""
        if not self.wants(op):
            return launch()
        self.bytes_by_level[level] = self.bytes_by_level.get(level, 0) + nbytes
        if level != WORLD:
            op_name = f"{op} | {level}"
        else:
            op_name = op
        synchronize(device)  # work queued before the collective is not its latency
        t0 = time.perf_counter()
        work = launch()
        wait = getattr(work, "wait", None)
        if wait is not None:
            wait()  # the caller's own wait() later returns at once
        synchronize(device)
        seconds = time.perf_counter() - t0
        # Frames: run <- collectives._logged <- the collective <- its caller.
        name = f"{op_name} | [Caller Func: {sys._getframe(3).f_code.co_name}]" if self.debug else op_name
        self.record(op, name, nbytes, seconds)
        return work

    def record(self, op: str, name: str, nbytes: int, seconds: float) -> None:
        """File one call of ``op`` (shown as ``name``) over ``nbytes`` that took ``seconds``."""
        sizes = self.records.get(name)
        if sizes is None:
            sizes = self.records[name] = {}
        rec = sizes.get(nbytes)
        if rec is None:  # not setdefault: that would build a record (and its deque) on every call
            rec = sizes[nbytes] = OpRecord()
        rec.add(seconds)
        self._unreported = True
        if self.verbose and self.rank == 0:
            algbw = _gbps(nbytes, seconds)
            logger.info("comm op: %s | time (ms): %.2f | msg size: %s | algbw (Gbps): %.2f | busbw (Gbps): %.2f",
                        name, seconds * 1e3, convert_size(nbytes), algbw, algbw * bus_factor(op, self.world))

    # -- the summary ---------------------------------------------------------------------------
    def summary(self, print_log: bool = True, reset: bool = False) -> dict[str, Any]:
        """DeepSpeed's ``log_summary(return_dict=True)`` dictionary for this rank; with ``print_log``
        rank 0 logs the table. ``reset`` clears the records afterwards."""
        out: dict[str, Any] = {"summary": {}, "straggler_analysis": None,
                               "metadata": {"world_size": self.world, "rank": self.rank,
                                            "timestamp": datetime.now().isoformat()}}
        for name, sizes in self.records.items():
            op = name.split(" | ")[0]
            entries = out["summary"][name] = {}
            for nbytes, rec in sorted(sizes.items()):
                lats = list(rec.latencies)
                algbw = trim_mean([_gbps(nbytes, s) for s in lats])
                entries[nbytes] = {
                    "count": rec.count, "total_latency_ms": rec.total_s * 1e3,
                    "avg_latency_ms": trim_mean(lats) * 1e3, "tput_avg_gbps": algbw,
                    "busbw_avg_gbps": trim_mean([_gbps(nbytes, s) * bus_factor(op, self.world) for s in lats]),
                    "msg_size_bytes": nbytes, "msg_size_str": convert_size(nbytes),
                }
        if print_log and self.rank == 0:
            logger.info("communication summary (rank 0, %d ranks)\n%s", self.world, format_table(out["summary"]))
        self._unreported = False
        if reset:
            self.records.clear()
            self.bytes_by_level.clear()
        return out


def format_table(summary: dict[str, dict[int, dict[str, Any]]]) -> str:
    """DeepSpeed's summary table: one line per op, then one per message size."""
    lines = ["".join(f"{c: <20}" for c in _COLUMNS)]
    for name, sizes in summary.items():
        lines.append(name)
        for e in sizes.values():
            lines.append(f"{' ': <20}{e['msg_size_str']: <20}{e['count']: <20}{e['total_latency_ms']: <20.2f}"
                         f"{e['avg_latency_ms']: <20.2f}{e['tput_avg_gbps']: <20.2f}{e['busbw_avg_gbps']: <20.2f}")
    return "\n".join(lines)


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> dict[str, Any] | None:
    """DeepSpeed's ``deepspeed.comm.log_summary``: rank 0 logs the installed logger's table; with
    ``return_dict`` every rank gets its dictionary."""
    rec = C.HOOK.recorder
    if not isinstance(rec, CommsLogger):
        raise ConfigError("log_summary() needs the communication logger: set it to true", key="comms_logger.enabled")
    if show_straggler:
        raise NotYetSupportedError("log_summary(show_straggler=True) is not supported yet", key="show_straggler")
    out = rec.summary(print_log=True)
    return out if return_dict else None


_exit_registered = False


def _register_exit_summary() -> None:
    """At exit, rank 0 prints what the installed logger recorded since its last summary."""
    global _exit_registered
    if not _exit_registered:
        atexit.register(_summary_at_exit)
        _exit_registered = True


def _summary_at_exit() -> None:
    rec = C.HOOK.recorder
    if isinstance(rec, CommsLogger) and rec._unreported:
        rec.summary(print_log=True)
