"""Hostfiles and resource filters in DeepSpeed's formats: pure parsing, no processes, no torch.

``zeroshard launch`` (``launch.py``) reads what machines a job may use from here; ``multinode.py``
turns the result into one command per host. The semantics follow DeepSpeed 0.19's launcher
(``deepspeed/launcher/runner.py``: ``fetch_hostfile``, ``parse_resource_filter``,
``parse_inclusion_exclusion``, ``apply_num_nodes_and_gpus``) so that a DeepSpeed hostfile and
``--include``/``--exclude`` string select the same hosts and slots; where DeepSpeed crashes on bad
input (a line it cannot read, ``host:a``), this module raises :class:`ResourceError` naming the
file and line or the option instead.

A *resource pool* is ``{host: slot count}`` in hostfile order; *active resources* are
``{host: [slot ids]}``, the slots (accelerator indices) each host runs a process for.

Hostfile format (MPI style), one host per line::

    # comment
    worker-0 slots=4
    worker-1 slots=4   # trailing comments and other key=value fields (max_slots=8) are ignored
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

_HOST_LINE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\d+)(?P<rest>.*)$")
_EXTRA_FIELD = re.compile(r"^\S+=\S*$")


class ResourceError(ValueError):
    """A hostfile, ``--include``/``--exclude`` string or size option that cannot be used."""


def parse_hostfile(lines: Iterable[str], source: str = "<hostfile>") -> dict[str, int]:
    """Read ``host slots=N`` lines into ``{host: N}``, in file order.

    Args:
        lines: the hostfile's lines.
        source: the file name, for error messages.

    Raises:
        ResourceError: naming ``source`` and the line for a line that is not ``host slots=N``, a
            host listed twice, ``slots=0``, or a file without any host.
    """
    pool: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOST_LINE.match(line)
        if match is None or not all(_EXTRA_FIELD.match(f) for f in match["rest"].split()):
            raise ResourceError(
                f"{source}:{number}: expected 'HOST slots=N' (e.g. 'worker-0 slots=4'), got {raw.strip()!r}"
            )
        host, slots = match["host"], int(match["slots"])
        if host in pool:
            raise ResourceError(
                f"{source}:{number}: host {host!r} is listed twice (first on line {first_line[host]})"
            )
        if slots < 1:
            raise ResourceError(f"{source}:{number}: host {host!r} has slots={slots}; it needs at least 1")
        pool[host] = slots
        first_line[host] = number
    if not pool:
        raise ResourceError(f"{source}: no hosts (expected lines like 'worker-0 slots=4')")
    return pool


def read_hostfile(path: str | Path) -> dict[str, int]:
    """:func:`parse_hostfile` on a file; a missing or unreadable file is a :class:`ResourceError`."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as error:
        raise ResourceError(f"cannot read hostfile {str(path)!r}: {error.strerror or error}") from None
    return parse_hostfile(text.splitlines(), str(path))


def parse_node_specs(spec: str, option: str = "--include") -> dict[str, list[int]]:
    """Parse ``NAME[:SLOT[,SLOT...]][@NAME...]`` into ``{host: sorted slots}`` (``[]``: the whole host).

    As DeepSpeed, a host named twice collects the slots of both mentions, so ``a@a:1`` is slot 1 of
    ``a`` only.
    """
    nodes: dict[str, list[int]] = {}
    for part in spec.split("@"):
        host, colon, slot_text = part.partition(":")
        if not host:
            raise ResourceError(f"argument {option}: empty host name in {spec!r} (format: host[:0,1][@host2...])")
        slots: list[int] = []
        if colon:
            for item in slot_text.split(","):
                if not item.isdigit():
                    raise ResourceError(
                        f"argument {option}: slot {item!r} of host {host!r} is not a non-negative integer "
                        f"in {spec!r}"
                    )
                slots.append(int(item))
        nodes[host] = sorted(set(nodes.get(host, []) + slots))
    return nodes


def filter_resources(pool: dict[str, int], include: str = "", exclude: str = "") -> dict[str, list[int]]:
    """The slots of ``pool`` that ``--include`` keeps or ``--exclude`` leaves, in hostfile order.

    Hosts left without slots are dropped. Raises :class:`ResourceError` for both filters at once,
    or a host or slot the pool does not have.
    """
    if include and exclude:
        raise ResourceError("arguments --include and --exclude: not allowed together")
    active = {host: list(range(slots)) for host, slots in pool.items()}
    if not include and not exclude:
        return active
    option = "--include" if include else "--exclude"
    chosen: dict[str, list[int]] = {} if include else {h: list(s) for h, s in active.items()}
    for host, slots in parse_node_specs(include or exclude, option).items():
        if host not in active:
            raise ResourceError(f"argument {option}: host {host!r} is not in the hostfile ({', '.join(active)})")
        for slot in slots:
            if slot not in active[host]:
                raise ResourceError(
                    f"argument {option}: host {host!r} has no slot {slot} (slots 0..{len(active[host]) - 1})"
                )
        if include:
            chosen[host] = slots or active[host]
        else:
            chosen[host] = [s for s in chosen[host] if s not in slots] if slots else []
    return {host: chosen[host] for host in active if chosen.get(host)}


def limit_resources(active: dict[str, list[int]], num_nodes: int | None, num_gpus: int | None) -> dict[str, list[int]]:
    """DeepSpeed's ``--num_nodes``/``--num_gpus`` on a hostfile: the first ``num_nodes`` hosts,
    each running slots ``0 .. num_gpus-1`` (not capped by the hostfile's slots, as DeepSpeed)."""
    if num_nodes is not None:
        if num_nodes > len(active):
            raise ResourceError(f"argument --num_nodes: {num_nodes} nodes asked for, the hostfile has {len(active)}")
        active = dict(list(active.items())[:num_nodes])
    if num_gpus is not None:
        active = {host: list(range(num_gpus)) for host in active}
    return active


def visible_devices(slots: list[int]) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` value a host needs for ``slots``, or ``None`` for ``0..n-1``
    (then the default device numbering already matches and the variable is left alone)."""
    if slots == list(range(len(slots))):
        return None
    return ",".join(str(s) for s in slots)
