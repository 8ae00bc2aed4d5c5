"""What one benchmark job is: the plan that ``run.py`` builds and ``worker.py`` executes.

Plain dataclasses and constants only (no torch import): the parent process uses them to plan and
launch, the worker to rebuild the same job from JSON.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

SYSTEMS: tuple[str, ...] = ("zeroshard", "zeroshard_reshard", "deepspeed", "ddp", "zero_redundancy", "fsdp2")
"""Every system the benchmark knows, in table order."""

SYSTEM_LABELS: dict[str, str] = {
    "zeroshard": "zeroshard",
    "zeroshard_reshard": "zeroshard, one block live (as FSDP2)",
    "deepspeed": "DeepSpeed",
    "ddp": "torch DDP",
    "zero_redundancy": "torch ZeroRedundancyOptimizer",
    "fsdp2": "torch FSDP2",
}

LIBRARIES: dict[str, tuple[str, str]] = {
    "zeroshard": ("zeroshard", "pip install -e ."),
    "zeroshard_reshard": ("zeroshard", "pip install -e ."),
    "deepspeed": ("deepspeed", "pip install -e '.[bench]' (DeepSpeed 0.19.x)"),
}
"""Systems that need a package beyond torch: (importable name, how to install it)."""

FIXED_STAGE: dict[str, int] = {"ddp": 0, "zero_redundancy": 1, "fsdp2": 3, "zeroshard_reshard": 3}
"""The ZeRO stage each torch baseline is equivalent to (what it shards); ``zeroshard_reshard`` is
zeroshard's stage 3 at the setting that matches FSDP2's ``reshard_after_forward=True`` (the
equal-memory comparison)."""


@dataclass(frozen=True)
class ModelSize:
    """A GPT shape (see ``examples/gpt.py``); byte-level vocabulary, untied embeddings, as many
    positions as the sequence length, unless the size says otherwise."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int = 256
    tie_weights: bool = False
    positions: int = 0
    """Position embeddings; 0: the workload's ``seq_len``."""


SIZES: dict[str, ModelSize] = {
    "25m": ModelSize("25m", n_layer=8, n_embd=512, n_head=8),
    "120m": ModelSize("120m", n_layer=12, n_embd=896, n_head=14),
    # GPT-2 small's shape (124,439,808 parameters): its vocabulary, tied embeddings, 1,024 positions.
    "124m": ModelSize("124m", n_layer=12, n_embd=768, n_head=12, vocab_size=50257, tie_weights=True, positions=1024),
    # For ``--device cuda``: large enough that a step is not launch-bound on an H100/H200.
    "300m": ModelSize("300m", n_layer=24, n_embd=1024, n_head=16),
    "1b": ModelSize("1b", n_layer=24, n_embd=2048, n_head=16),
}


@dataclass(frozen=True)
class Workload:
    """Training loop shape, identical for every system in one invocation."""

    seq_len: int = 64
    micro_batch: int = 4
    grad_accum: int = 1
    warmup_steps: int = 2
    measure_steps: int = 6
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 1234
    bucket_numel: int = 6_553_600
    """Gradient/all-gather bucket (elements) for zeroshard and DeepSpeed: DDP's default 25 MiB of fp32."""


@dataclass(frozen=True)
class Job:
    """One fresh multi-rank run: a system at a stage on a model size."""

    system: str
    stage: int
    size: str
    device: str = "cpu"
    world_size: int = 2
    offload: bool = False
    dtype: str = "fp32"
    workload: Workload = field(default_factory=Workload)
    members: tuple[tuple[str, int], ...] = ()
    """A *paired* job: these (system, stage) pairs train side by side in the same processes, one step
    each in turn (rotating who goes first), so that every system sees the same machine load. Empty
    for an ordinary job (``system`` at ``stage``)."""

    @property
    def key(self) -> str:
        """Unique, file-name-safe identifier."""
        off = "-offload" if self.offload else ""
        who = "paired" if self.members else self.system
        return f"{self.size}-{who}-s{self.stage}{off}-{self.device}"

    @property
    def variant(self) -> str:
        """Stage label as shown in tables: ``2`` or ``2+offload``."""
        return f"{self.stage}+offload" if self.offload else str(self.stage)

    def to_json(self) -> str:
        """Serialise for the worker's command line."""
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> Job:
        """Inverse of :meth:`to_json`."""
        raw: dict[str, Any] = json.loads(text)
        wl = raw.pop("workload")
        wl["betas"] = tuple(wl["betas"])
        members = tuple((str(sys_), int(st)) for sys_, st in raw.pop("members", []))
        return Job(workload=Workload(**wl), members=members, **raw)

    def member(self, system: str, stage: int) -> Job:
        """The ordinary job of one member of a paired job."""
        return replace(self, system=system, stage=stage, members=())


def paired_members(stage: int, systems: list[str]) -> tuple[tuple[str, int], ...]:
    """Who trains side by side at ``stage``: zeroshard, DeepSpeed, the torch system of that stage, and
    DDP (the reference every stage is compared with), restricted to ``systems``."""
    wanted = ["zeroshard", "deepspeed"] + [s for s, st in FIXED_STAGE.items() if st == stage and s != "ddp"] + ["ddp"]
    return tuple((s, FIXED_STAGE.get(s, stage)) for s in wanted if s in systems)


def zero_formula_bytes(numel: int, stage: int, world: int, param_bytes: int) -> int:
    """Model-state bytes per rank that the ZeRO paper's accounting allows for AdamW.

    ``P·Ψ`` parameters + ``P·Ψ`` gradients + ``K·Ψ`` optimizer state, where parameters are sharded
    from stage 3, gradients from stage 2 and optimizer state from stage 1 (divided by ``world``).
    ``K`` is 8 (two fp32 Adam moments) plus 4 for an fp32 master copy when the parameters are not
    fp32 (``K = 12`` for 16-bit training, as in the paper). In fp32 training the parameters *are* the
    master weights, so a separate fp32 master copy counts as overhead.
    """
    k = 8 + (0 if param_bytes == 4 else 4)
    params = param_bytes * numel / (world if stage >= 3 else 1)
    grads = param_bytes * numel / (world if stage >= 2 else 1)
    optim = k * numel / (world if stage >= 1 else 1)
    return int(params + grads + optim)
