"""A cheap check that every rank did the same thing, before gradients are reduced.

Ranks that disagree (one skipped a backward, under ZeRO-3 one ran other modules) can pair
collectives of the same size that were never meant to meet: training goes on, silently wrong,
or hangs later somewhere unrelated. Before a backward reduces gradients (every micro-step at
stages 2–3, the last micro-step of the window at stages 0–1), every rank contributes a few
integers (its optimizer step, the micro-step of the window, the forwards and backwards of the
window so far, and under ZeRO-3 a hash of the sequence of units it gathered) to one small
all-gather. A difference raises :class:`DistributedError` on every rank, naming the ranks and
what differs; for ZeRO-3 a second all-gather (only then) finds the first module where the
sequences part.

Cost: one all-gather of ``5 × 8`` bytes per check (``benchmarks/agreement_cost.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zeroshard.comm import collectives as C
from zeroshard.errors import DistributedError

FIELDS = ("optimizer step", "micro-step of the window", "forward passes in the window",
          "backward passes in the window", "ZeRO-3 gather sequence")
SEQUENCE = len(FIELDS) - 1
#: ZeRO-3 unit requests kept per window for the diagnosis (beyond it only the hash is compared).
MAX_LOGGED = 100_000
_MOD = (1 << 61) - 1


def extend_hash(h: int, unit_index: int) -> int:
    """The running hash of a sequence of unit indices (polynomial, mod a Mersenne prime)."""
    return (h * 1_000_003 + unit_index + 1) % _MOD


def check(values: list[int], group: dist.ProcessGroup | None, where: str,
          sequence: list[int] | None = None, unit_names: list[str] | None = None) -> None:
    """Raise on every rank if ranks disagree on ``values`` (one per :data:`FIELDS`)."""
    world = C.world_size(group)
    if world == 1:
        return
    device = C.control_device(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    rows = torch.empty(world, len(values), dtype=torch.int64, device=device)
    C.all_gather(rows.view(-1), mine, group, async_op=False, what="all-gather of the per-step agreement check")
    if bool((rows == rows[0]).all()):
        return
    lines = []
    for j, field in enumerate(FIELDS[: len(values)]):
        column = rows[:, j].tolist()
        if len(set(column)) > 1:
            shown = column if j != SEQUENCE else ["same as rank 0" if v == column[0] else "differs"
                                                       for v in column]
            lines.append(f"  {field}: " + ", ".join(f"rank {r}: {v}" for r, v in enumerate(shown)))
    if sequence is not None and rows[:, SEQUENCE].unique().numel() > 1:
        lines.append("  " + _first_divergence(sequence, group, world, unit_names or []))
    raise DistributedError(
        f"ranks disagree at {where}:\n" + "\n".join(lines) + "\nEvery rank must run the same number of "
        "forward and backward passes per optimizer step" + (", and under ZeRO-3 the same modules in the "
        "same order (their parameters are gathered with collectives)" if sequence is not None else "") + "."
    )


def _first_divergence(sequence: list[int], group: dist.ProcessGroup | None, world: int,
                      names: list[str]) -> str:
    """Where the ranks' ZeRO-3 gather sequences first differ (two more small all-gathers)."""
    rows = C.gather_ragged(sequence, group, "gather sequences")
    i = C.first_difference(rows)
    if i is None:
        return "the gather sequences differ beyond the part kept for diagnosis"

    def name(u: int) -> str:
        return "nothing (its sequence ended)" if u < 0 else repr(names[u] if u < len(names) else u)

    return (f"the modules first differ at gather {i} of the window: "
            + ", ".join(f"rank {r} gathered {name(int(rows[r, i]))}" for r in range(world)))
