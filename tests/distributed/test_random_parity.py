"""Conditional models: parity with plain PyTorch when module usage changes step to step.

Two parts:

- The reported repro (issue 15): ``inp -> a|b -> out`` with the branch alternating per step, and a
  module called once on most steps and twice on some, at every stage on 1 and 2 ranks: the
  gradients the optimizer receives at every step and the final parameters equal plain PyTorch
  (fp32, relative 1e-5). The repro's config sets no ``gradient_clipping``, so DeepSpeed's default
  of 1.0 applies: its reference must clip too (that default, not the gradient path, is what made
  the report's gradients differ), and without clipping the plain loop is matched as is.
- A bounded randomized sweep (``tests/random_models.py``): every stage at world sizes 1, 2 and 4,
  three seeds each; modules run in random order, repeated, never in a window, on one rank only
  (stages 0–2); random accumulation, overlap, clipping, bucket and ZeRO-3 budgets.
  ``scripts/fuzz_parity.py`` runs as many cases as asked.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from random_models import Case, cases_worker, compare, reference

SEEDS_PER_CELL = 3
STAGES = (0, 1, 2, 3)


def _repro_case(stage: int, world: int, clip: float, pattern: str) -> Case:
    """The report's model: blocks 0 and 1 are the branches ``a`` and ``b``, one micro-step, 9 steps."""
    return replace(Case.draw(4242, world=world, stage=stage), ga=1, steps=9, blocks=2, clip=clip,
                   weight_decay=0.0, overlap=True, live=1_000_000_000, prefetch=50_000_000, persistence=0,
                   reduce_bucket=500_000_000, pattern=pattern)


@pytest.mark.parametrize("world", [1, 2])
def test_reported_conditional_models(world: int) -> None:
    cases = [_repro_case(stage, world, clip, pattern) for stage in STAGES
             for clip, pattern in ((0.0, "alternate"), (1.0, "alternate"), (0.0, "repeat"))]
    results = run_distributed(cases_worker, world, [asdict(c) for c in cases])
    failures = []
    for i, case in enumerate(cases):
        problems = compare(case, [r[i] for r in results], reference(case))
        if problems:
            failures.append(f"stage {case.stage} clip {case.clip} {case.pattern}: {problems[:4]}")
    assert not failures, "\n".join(failures)


def _sweep(world: int) -> list[Case]:
    return [Case.draw(10_000 * world + 100 * stage + k, world=world, stage=stage)
            for stage in STAGES for k in range(SEEDS_PER_CELL)]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_randomized_module_usage(world: int) -> None:
    cases = _sweep(world)
    results = run_distributed(cases_worker, world, [asdict(c) for c in cases])
    failures = []
    for i, case in enumerate(cases):
        problems = compare(case, [r[i] for r in results], reference(case))
        if problems:
            failures.append(f"{case.describe()}\n    " + "\n    ".join(problems[:6]))
    assert not failures, "\n".join(failures)


def test_compare_catches_a_wrong_gradient_and_a_wrong_skip() -> None:
    """The checker itself can fail: a perturbed gradient, a spurious gradient and a missing one."""
    case = Case.draw(3, world=1, stage=0)
    ref = reference(case)

    def as_rank(res: dict) -> dict:
        grads = [{n: None if g is None else (0, g.numel(), g.reshape(-1).clone()) for n, g in step.items()}
                 for step in res["grads"]]
        return {"grads": grads, "params": {n: t.clone() for n, t in res["params"].items()}, "steps": case.steps}

    assert compare(case, [as_rank(ref)], ref) == []
    wrong = as_rank(ref)
    name = next(n for n, g in ref["grads"][1].items() if g is not None)
    wrong["grads"][1][name][2].mul_(1.01)  # one tensor off by 1%
    assert any(f"step 1 {name}: gradient rel. error" in p for p in compare(case, [wrong], ref))
    subtle = as_rank(ref)  # every tensor of a step off by 5e-5: only the whole-step bound sees it
    for entry in subtle["grads"][2].values():
        if entry is not None:
            entry[2].mul_(1 + 5e-5)
    step2 = [p for p in compare(case, [subtle], ref) if "step 2" in p]
    assert len(step2) == 1 and step2[0].startswith("step 2: the optimizer's gradient has rel. error"), step2
    spurious = as_rank(ref)
    unused = [(s, n) for s, step in enumerate(ref["grads"]) for n, g in step.items() if g is None]
    if unused:
        s, n = unused[0]
        spurious["grads"][s][n] = (0, 1, torch.zeros(1))
        assert any("no rank used it" in p for p in compare(case, [spurious], ref))
    missing = as_rank(ref)
    missing["grads"][0][name] = None
    assert any("got no gradient" in p for p in compare(case, [missing], ref))


def test_default_clipping_is_announced(tmp_path: Path) -> None:
    """A config without ``gradient_clipping`` clips at 1.0 like DeepSpeed, and says so on stderr
    (with no logging configured); an explicit value is silent."""
    script = textwrap.dedent("""
        import os, sys, torch
        import zeroshard
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
        if sys.argv[1] == "set":
            cfg["gradient_clipping"] = 1.0
        model = torch.nn.Linear(3, 2)
        zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    """)
    path = tmp_path / "clip.py"
    path.write_text(script)
    unset = subprocess.run([sys.executable, str(path), "unset", "29531"], capture_output=True, text=True, timeout=120)
    explicit = subprocess.run([sys.executable, str(path), "set", "29532"], capture_output=True, text=True, timeout=120)
    assert unset.returncode == 0 and explicit.returncode == 0, unset.stderr + explicit.stderr
    assert "gradient_clipping is not set" in unset.stderr
    assert "gradient_clipping" not in explicit.stderr
