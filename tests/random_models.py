"""Randomized parity: models whose module usage changes per step, micro-step and rank.

A :class:`Case` is drawn from one integer seed. Its model (:class:`Mixer`) runs, for every
(step, micro-step, rank), a *plan*: a random sequence of block indices, so that modules run in a
random order, some more than once, some never in a whole accumulation window, and (stages 0–2)
some on one rank only. ZeRO-3 gathers parameters with collectives inside each module's forward,
so there every rank must run the same modules in the same order (as in DeepSpeed): its plans
vary per step and micro-step, not per rank.

``run_case`` trains the case through the public API on this rank and records the gradients the
wrapped torch optimizer receives at every step (after reduction, unscaling and clipping), and the
final parameters. ``reference`` trains the same model on the same global batches with plain
single-process PyTorch. ``compare`` returns the differences. Used by
``tests/distributed/test_random_parity.py`` (a bounded number of cases in CI) and
``scripts/fuzz_parity.py`` (as many as asked).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IN, DIM, HID, OUT = 5, 13, 7, 3  # element counts no world size of 2 or 4 divides
MICRO_BS = 3
LR = 1e-2

Plans = list[list[list[list[int]]]]  # [step][micro][rank] -> block indices, in execution order


@dataclass(frozen=True)
class Case:
    """One randomized configuration (everything derives from ``seed``)."""

    seed: int
    stage: int
    world: int
    ga: int
    steps: int
    blocks: int
    overlap: bool
    clip: float
    weight_decay: float
    reduce_bucket: int
    allgather_bucket: int
    live: int
    prefetch: int
    persistence: int
    #: ``random``; or the reported repro's fixed patterns (blocks 0 and 1 are branches ``a`` and ``b``):
    #: ``alternate`` runs ``a`` on even steps and ``b`` on odd ones, ``repeat`` runs ``a`` once on
    #: most steps and twice on every third.
    pattern: str = "random"

    @staticmethod
    def draw(seed: int, world: int | None = None, stage: int | None = None) -> Case:
        """A random case; ``world`` and ``stage`` may be fixed by the caller."""
        r = random.Random(seed)
        return Case(
            seed=seed,
            # Drawn even when fixed, so that a seed means the same case whatever is fixed.
            stage=_given(stage, r.choice([0, 1, 2, 3])),
            world=_given(world, r.choice([1, 2, 4])),
            ga=r.randint(1, 3),
            steps=r.randint(3, 5),
            blocks=r.randint(3, 6),
            overlap=r.random() < 0.5,
            clip=r.choice([0.0, 0.0, 1.0, 0.05]),
            weight_decay=r.choice([0.0, 0.01]),
            # Small buckets put parameters of used and unused modules together in one collective.
            reduce_bucket=r.choice([120, 400, 500_000_000]),
            allgather_bucket=r.choice([150, 500_000_000]),
            # ZeRO-3: a budget below one unit releases everything at once; a large one keeps all.
            live=r.choice([50, 400, 1_000_000_000]),
            prefetch=r.choice([0, 300, 50_000_000]),
            persistence=r.choice([0, 0, 100]),
        )

    def plans(self) -> Plans:
        """``plans[step][micro][rank]``: the blocks each forward runs."""
        if self.pattern != "random":
            fixed = {"alternate": lambda s: [s % 2], "repeat": lambda s: [0, 0] if s % 3 == 2 else [0]}[self.pattern]
            return [[[fixed(step)] * self.world for _m in range(self.ga)] for step in range(self.steps)]
        r = random.Random(self.seed * 7919 + 1)
        out: Plans = []
        for _ in range(self.steps):
            # Blocks that no rank runs anywhere in this window (plain PyTorch: .grad stays None).
            banned = {b for b in range(self.blocks) if r.random() < 0.25}
            allowed = [b for b in range(self.blocks) if b not in banned]
            window = []
            for _m in range(self.ga):
                same = self._draw_plan(r, allowed)
                per_rank = [same if self.stage == 3 else self._draw_plan(r, allowed) for _ in range(self.world)]
                window.append(per_rank)
            out.append(window)
        return out

    @staticmethod
    def _draw_plan(r: random.Random, allowed: list[int]) -> list[int]:
        if not allowed or r.random() < 0.1:
            return []
        n = r.randint(0, len(allowed) + 2)  # repeats: a block may run several times
        return [r.choice(allowed) for _ in range(n)]

    def config(self) -> dict[str, Any]:
        """The DeepSpeed-style config of the case (fp32)."""
        return {
            "train_micro_batch_size_per_gpu": MICRO_BS,
            "gradient_accumulation_steps": self.ga,
            "gradient_clipping": self.clip,
            "zero_optimization": {
                "stage": self.stage,
                "overlap_comm": self.overlap,
                "reduce_bucket_size": self.reduce_bucket,
                "allgather_bucket_size": self.allgather_bucket,
                "stage3_max_live_parameters": self.live,
                "stage3_prefetch_bucket_size": self.prefetch,
                "stage3_param_persistence_threshold": self.persistence,
            },
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": self.weight_decay}},
        }

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in asdict(self).items())


def _given(fixed: int | None, drawn: int) -> int:
    return drawn if fixed is None else fixed


class Block(nn.Module):
    """A residual MLP block: two modules (two ZeRO-3 units) of odd sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HID)
        self.down = nn.Linear(HID, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(h)))


class Mixer(nn.Module):
    """``embed`` and ``head`` run every time; between them, the blocks the plan names, in its order."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor, plan: list[int]) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for i in plan:
            h = self.blocks[i](h)
        return self.head(h)


def build(case: Case) -> Mixer:
    torch.manual_seed(case.seed)
    return Mixer(case.blocks)


def data(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets ``[steps, ga, world, MICRO_BS, ...]``."""
    g = torch.Generator().manual_seed(case.seed + 17)
    shape = (case.steps, case.ga, case.world, MICRO_BS)
    return torch.randn(*shape, IN, generator=g), torch.randn(*shape, OUT, generator=g)


def run_case(rank: int, case: Case) -> dict[str, Any]:
    """Train ``case`` on this rank through zeroshard's public API.

    Returns ``grads[step][name] = (start, end, values)`` for every master the torch optimizer
    received a gradient for (``None`` when it received none), and the final full parameters.
    """
    import zeroshard

    model = build(case)
    plans = case.plans()
    x, y = data(case)
    engine, optimizer, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                                   config=case.config())
    # Observation only: which master views the torch optimizer steps, and with what gradient.
    names = {id(optimizer.master.views[p]): (n, optimizer.master.ranges[p]) for n, p in model.named_parameters()}
    grads: list[dict[str, Any]] = []

    def record(opt: torch.optim.Optimizer, *_: Any) -> None:
        seen: dict[str, Any] = {}
        for group in opt.param_groups:
            for master in group["params"]:
                name, (s, e) = names[id(master)]
                seen[name] = None if master.grad is None else (s, e, master.grad.detach().clone())
        grads.append(seen)

    optimizer.optimizer.register_step_pre_hook(record)
    for step in range(case.steps):
        for m in range(case.ga):
            loss = F.mse_loss(engine(x[step, m, rank], plans[step][m][rank]), y[step, m, rank])
            engine.backward(loss)
            engine.step()
    coordinator = getattr(optimizer, "coordinator", None)
    live = {} if coordinator is None else {  # of training, before the whole model is gathered below
        "peak": coordinator.peak_gathered_numel, "largest_unit": max(u.numel for u in coordinator.units)}
    with engine.gathered():
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"grads": grads, "params": params, "steps": engine.global_steps, "live": live}


def reference(case: Case) -> dict[str, Any]:
    """Plain single-process PyTorch on the same global batches: the loss of every (micro-step,
    rank) divided by ``ga * world``, global-norm clipping, ``zero_grad(set_to_none=True)``."""
    model = build(case)
    plans = case.plans()
    x, y = data(case)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=case.weight_decay, fused=True)
    grads = []
    for step in range(case.steps):
        opt.zero_grad(set_to_none=True)
        for m in range(case.ga):
            for r in range(case.world):
                loss = F.mse_loss(model(x[step, m, r], plans[step][m][r]), y[step, m, r])
                (loss / (case.ga * case.world)).backward()
        if case.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        grads.append({n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
    return {"grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.norm().item()
    return (a - b).norm().item() / scale if scale > 0 else (a - b).norm().item()


#: Bound on one tensor's gradient, relative to its own norm. The whole step's gradient and the final
#: parameters are held to ``tol`` (1e-5); a single small tensor whose gradient nearly cancels (a
#: bias) can show more: with clipping, the global norm is summed in another order (flat buckets
#: against torch's per-tensor norms), the parameters drift apart by ~1e-7 and that tensor's
#: gradient by up to ~1.4e-5 (measured; without clipping the same cases are bit-identical). A
#: missing or stale contribution is an error of order 1 on its tensor.
TENSOR_TOL = 1e-3


def compare(case: Case, ranks: list[dict[str, Any]], ref: dict[str, Any], tol: float = 1e-5) -> list[str]:
    """Every disagreement between the ranks' results and the reference (empty: parity)."""
    problems = []
    for r, res in enumerate(ranks):
        if res["steps"] != case.steps or len(res["grads"]) != case.steps:
            problems.append(f"rank {r}: {len(res['grads'])} of {res['steps']} optimizer steps applied, "
                            f"expected {case.steps}")
    if problems:
        return problems
    for step, want in enumerate(ref["grads"]):
        step_got, step_want = [], []
        for name, g in want.items():
            got = [res["grads"][step].get(name) for res in ranks]
            if g is None:
                if any(x is not None for x in got):
                    problems.append(f"step {step} {name}: no rank used it, yet the optimizer got a gradient")
                continue
            if all(x is None for x in got):
                problems.append(f"step {step} {name}: used, yet the optimizer got no gradient")
                continue
            full = torch.full((g.numel(),), float("nan"))
            for x in got:
                if x is not None:
                    s, e, values = x
                    full[s:e] = values
            if torch.isnan(full).any():
                problems.append(f"step {step} {name}: gradient elements missing on every rank")
                continue
            err = _rel(full, g.reshape(-1))
            if err > TENSOR_TOL:
                problems.append(f"step {step} {name}: gradient rel. error {err:.2e}")
            step_got.append(full)
            step_want.append(g.reshape(-1))
        if step_want:
            err = _rel(torch.cat(step_got), torch.cat(step_want))
            if err > tol:
                problems.append(f"step {step}: the optimizer's gradient has rel. error {err:.2e}")
    for r, res in enumerate(ranks):
        live = res.get("live")
        # ZeRO-3: gathered at once at most the live budget, the prefetch window and the units in use
        # (the running module, a unit gathered for backward, the most recently used one).
        if live and live["peak"] > case.live + case.prefetch + 3 * live["largest_unit"]:
            problems.append(f"rank {r}: {live['peak']} parameters gathered at once, over the live budget "
                            f"{case.live} + prefetch {case.prefetch} + 3 units of {live['largest_unit']}")
    flat_ref = torch.cat([t.reshape(-1) for t in ref["params"].values()])
    for r, res in enumerate(ranks):
        flat = torch.cat([res["params"][n].reshape(-1) for n in ref["params"]])
        err = _rel(flat, flat_ref)
        if err > tol:
            problems.append(f"rank {r}: parameters rel. error {err:.2e}")
    return problems


def cases_worker(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run several cases of this world size in one spawned job (amortises start-up)."""
    return [run_case(rank, Case(**c)) for c in cases]
