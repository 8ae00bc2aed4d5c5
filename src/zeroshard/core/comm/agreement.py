"""A cheap check that every rank did the same thing, before collectives that could pair wrongly.

Ranks that disagree (one skipped a backward, ran an extra micro-step, under ZeRO-3 ran other
modules) can pair collectives of the same size that were never meant to meet: training goes on,
silently wrong, or hangs later somewhere unrelated. So at a few points every rank contributes one
fixed-size row of integers to a small all-gather, and a difference raises
:class:`DistributedError` on every rank, naming the ranks and what differs:

- before a backward reduces gradients (every micro-step at stages 2–3, the last micro-step of the
  window at stages 0–1): the optimizer step, the micro-step of the window, the forwards and
  backwards of the window so far, and under ZeRO-3 a hash of the sequence of units it gathered
  (on a difference, a second all-gather finds the first module where the sequences part);
- at ``save_checkpoint``: the same, so a rank that ran an extra or a missing micro-step (one more
  batch in its data loader) is named there instead of saving a half-accumulated window;
- before each ZeRO-3 unit all-gather (:class:`GatherGuard`): under ZeRO-3 a rank that runs another
  module gathers other parameters already in the forward, and an all-gather whose size differs
  between ranks aborts the process inside gloo (and hangs or reads garbage with NCCL) before the
  backward's check could run. The guard needs a host synchronisation per gather, which stalls the
  prefetch pipeline (18% of a stage-3 step of a 5M-parameter model on 2 gloo ranks), so by default
  it runs during the first :data:`GUARDED_STEPS` optimizer steps only, where code that differs
  between ranks (``if rank == 0: ...``) shows at once; ``ZEROSHARD_VERIFY_GATHERS=1`` guards every
  gather (for a divergence that depends on the data), ``0`` none.

Every row has the same width, whatever the check, so checks of different kinds still pair (one
rank at its backward check while another gathers a unit or saves) and the error says what each
rank was doing. Cost: one all-gather of ``8 × 8`` bytes per check (``benchmarks/studies/agreement_cost.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from zeroshard.core.comm import collectives as C
from zeroshard.errors import DistributedError

FIELDS = ("optimizer step", "micro-step of the window", "forward passes in the window",
          "backward passes in the window", "ZeRO-3 gather sequence")
SEQUENCE = len(FIELDS) - 1
#: what a rank is doing when it checks (the row's first integer)
BACKWARD, GATHER, SAVE = 1, 2, 3
_KINDS = {BACKWARD: "backward", GATHER: "ZeRO-3 all-gather", SAVE: "save_checkpoint"}
_PHASES = ("forward", "backward", "explicit gather")
WIDTH = 8
#: ZeRO-3 unit requests kept per window for the diagnosis (beyond it only the hash is compared).
MAX_LOGGED = 100_000
_MOD = (1 << 61) - 1


def extend_hash(h: int, unit_index: int) -> int:
    """The running hash of a sequence of unit indices (polynomial, mod a Mersenne prime)."""
    return (h * 1_000_003 + unit_index + 1) % _MOD


def _exchange(row: list[int], group: dist.ProcessGroup | None, what: str) -> torch.Tensor:
    """Every rank's ``row`` (padded to :data:`WIDTH`) as ``[world, WIDTH]``."""
    device = C.control_device(group)
    mine = torch.tensor(row + [0] * (WIDTH - len(row)), dtype=torch.int64, device=device)
    rows = torch.empty(C.world_size(group), WIDTH, dtype=torch.int64, device=device)
    C.all_gather(rows.view(-1), mine, group, async_op=False, what=what)
    return rows


def _describe(row: list[int], ga: int | None, unit_names: list[str] | None) -> str:
    """What a rank was doing, from its row (for ranks whose checks are of different kinds)."""
    kind, step, micro, forwards, backwards, index, numel, phase = row
    if kind == GATHER:
        name = unit_names[index] if unit_names and 0 <= index < len(unit_names) else f"unit {index}"
        return (f"all-gather of ZeRO-3 unit {name!r} ({numel:,} elements) in the {_PHASES[phase]} of optimizer "
                f"step {step}")
    window = f"micro-step {micro + 1}" + (f" of {ga}" if ga else "")
    doing = "backward of" if kind == BACKWARD else "save_checkpoint at"
    return (f"{doing} {window} of optimizer step {step} ({forwards} forward and {backwards} backward passes "
            "in the window so far)")


def _mismatch(rows: torch.Tensor, ga: int | None, unit_names: list[str] | None) -> str:
    table = rows.tolist()
    if len({r[0] for r in table}) > 1 or table[0][0] == GATHER:
        return "\n".join(f"  rank {r}: {_describe(row, ga, unit_names)}" for r, row in enumerate(table))
    lines = []
    for j, field in enumerate(FIELDS, start=1):
        column = [row[j] for row in table]
        if len(set(column)) > 1:
            shown = column if j - 1 != SEQUENCE else ["same as rank 0" if v == column[0] else "differs"
                                                      for v in column]
            lines.append(f"  {field}: " + ", ".join(f"rank {r}: {v}" for r, v in enumerate(shown)))
    return "\n".join(lines)


def check(values: list[int], group: dist.ProcessGroup | None, where: str,
          sequence: list[int] | None = None, unit_names: list[str] | None = None,
          kind: int = BACKWARD, ga: int | None = None) -> None:
    """Raise on every rank if ranks disagree on ``values`` (one per :data:`FIELDS`) or are not all
    at a check of the same ``kind`` (:data:`BACKWARD` or :data:`SAVE`)."""
    if C.world_size(group) == 1:
        return
    rows = _exchange([kind, *values], group, "all-gather of the per-step agreement check")
    if bool((rows == rows[0]).all()):
        return
    text = _mismatch(rows, ga, unit_names)
    same_kind = bool((rows[:, 0] == kind).all())
    if same_kind and sequence is not None and rows[:, 1 + SEQUENCE].unique().numel() > 1:
        text += "\n  " + _first_divergence(sequence, group, C.world_size(group), unit_names or [])
    if not same_kind and bool((rows[:, 0] == SAVE).any()):
        text += ("\n  save_checkpoint is collective: call it on every rank, not under `if rank == 0:` "
                 "(each rank writes its own shard)")
    raise DistributedError(
        f"ranks disagree at {where}:\n{text}\nEvery rank must run the same number of forward and backward "
        "passes per optimizer step (a data loader with more batches on some ranks causes this)"
        + (", and under ZeRO-3 the same modules in the same order (their parameters are gathered with "
           "collectives: an evaluation or generate() on some ranks only causes this too; run it on every rank, "
           "and pass generate(..., synced_gpus=True) so that ranks whose generation ended keep stepping with "
           "the others). "
           + LEAF_HINT + " " + UNUSED_OUTPUT_HINT if sequence is not None else ".")
    )


#: modules that run where the data sends them: a mixture-of-experts block looping over the experts its
#: router picked runs different experts on different ranks
LEAF_HINT = (
    "Submodules chosen by the data (a mixture-of-experts block that runs only the experts its router "
    "picked) differ between ranks: mark the block a leaf, gathered whole on every rank, with "
    "`zeroshard.deepspeed.utils.set_z3_leaf_modules(model, [BlockClass])` before initialize or the config's "
    "`zero_optimization.leaf_module` (`{\"classes\": [\"BlockClass\"]}`)."
)

#: the backward half of "the same modules on every rank", which scripts break without a branch in forward
UNUSED_OUTPUT_HINT = (
    "Backward counts too: a module every rank runs but whose output some ranks' loss does not use "
    "(`if mask.any(): loss = loss + aux_loss`) is reached by backward, and gathered again, on the other "
    "ranks only; keep it in every rank's loss with a zero term (`loss = loss + 0 * aux_out.sum()`), "
    "which adds nothing to any gradient while the output is finite."
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


#: optimizer steps whose ZeRO-3 gathers are guarded by default (``ZEROSHARD_VERIFY_GATHERS`` unset)
GUARDED_STEPS = 2


def verify_gathers_mode() -> str:
    """How ZeRO-3 gathers are guarded (:class:`GatherGuard`): ``"all"``, ``"first"`` (the first
    :data:`GUARDED_STEPS` optimizer steps, the default) or ``"off"``, from ``ZEROSHARD_VERIFY_GATHERS``."""
    forced = os.environ.get("ZEROSHARD_VERIFY_GATHERS", "").strip().lower()
    if forced in ("1", "true", "yes", "on", "all"):
        return "all"
    if forced in ("0", "false", "no", "off"):
        return "off"
    return "first"


class GatherGuard:
    """Before a ZeRO-3 unit all-gather, every rank says which unit it is about to gather.

    Args:
        group: the data-parallel group the units gather over.
        unit_names: names of the units, by index.
        step: the engine's optimizer step (for the message), or ``None``.
    """

    def __init__(self, group: dist.ProcessGroup | None, unit_names: list[str],
                 step: Callable[[], int | None] | None = None, every_step: bool = False) -> None:
        self.group = group
        self.unit_names = unit_names
        self.step = step
        self.every_step = every_step

    def __call__(self, index: int, numel: int, phase: str, what: str) -> None:
        """Raise :class:`DistributedError` on every rank if the ranks are about to gather different
        units, or are not all gathering (``phase``: one of "forward", "backward", "explicit gather";
        ``what``: the gather, as failures and timeouts name it — the check is part of it)."""
        step = self.step() if self.step is not None else None
        if not self.every_step and step is not None and step >= GUARDED_STEPS:
            return  # every rank decides alike: the step count is checked to agree before each backward
        row = [GATHER, -1 if step is None else step, -1, -1, -1, index, numel, _PHASES.index(phase)]
        rows = _exchange(row, self.group, what)
        if bool((rows == rows[0]).all()):
            return
        raise DistributedError(
            f"ranks disagree on the next ZeRO-3 all-gather:\n{_mismatch(rows, None, self.unit_names)}\n"
            "Under ZeRO-3 every rank must run the same modules in the same order in each forward and backward "
            "(their parameters are gathered with collectives): a branch taken on some ranks only, or an extra "
            "forward on one rank, cannot be exchanged. " + LEAF_HINT + " " + UNUSED_OUTPUT_HINT
        )
