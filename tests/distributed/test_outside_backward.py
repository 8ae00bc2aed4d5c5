"""Backward passes outside ``engine.backward``: they leave ``.grad`` as plain PyTorch does.

- Adversarial training (FGSM): a plain ``loss.backward()`` for the input gradient, then
  ``module.zero_grad()``, then the training loss through ``engine.backward``. Before, the engine's
  gradient hooks took the plain backward's parameter gradients too, so they were trained on (stages
  0-2) or crashed the reduction (stage 3, ``KeyError``).
- A GAN with an engine per model (DeepSpeedExamples' ``gan_deepspeed_train.py``): the generator's
  loss backpropagates through the discriminator, whose engine took those gradients into its next
  step although the script clears them (``netD.zero_grad()``).
- ``loss.backward()`` instead of ``engine.backward(loss)``: the step is an error naming the parameter.

Reference: plain PyTorch on the global batch. 2 ranks, AdamW, clipping 1.0, odd parameter sizes.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from models import gathered_weights, make_data, make_model, relative_distance

import zeroshard

STEPS, MB, WORLD, LR, CLIP, EPS = 3, 4, 2, 1e-2, 1.0, 0.1
TOL = 1e-5
STAGES = [0, 1, 2, 3]


def _config(stage: int) -> dict:
    zero: dict = {"stage": stage}
    if stage == 3:  # every unit released and gathered again
        zero.update(stage3_param_persistence_threshold=0, stage3_max_live_parameters=0)
    return {"train_micro_batch_size_per_gpu": MB, "gradient_clipping": CLIP, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}}


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = make_data(STEPS, MB * WORLD)
    return x[step, rank * MB : (rank + 1) * MB], y[step, rank * MB : (rank + 1) * MB]


def _adversarial(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """FGSM: the input moved along the sign of its gradient, from a plain backward."""
    x = x.clone().requires_grad_(True)
    model(x, y).backward()
    return (x + EPS * x.grad.sign()).detach()


def fgsm_worker(rank: int, world: int, stage: int) -> dict[str, torch.Tensor]:
    model = make_model(0)
    engine, *_ = zeroshard.initialize(model=model, config=_config(stage))
    for step in range(STEPS):
        x, y = _batch(step, rank)
        x_adv = _adversarial(engine, x, y)
        model.zero_grad()
        engine.backward(engine(x_adv, y))
        engine.step()
    out = gathered_weights(engine)
    engine.destroy()
    return out


def fgsm_reference() -> dict[str, torch.Tensor]:
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for step in range(STEPS):
        advs = [(_adversarial(model, *_batch(step, r)), _batch(step, r)[1]) for r in range(WORLD)]
        opt.zero_grad()
        for x_adv, y in advs:
            (model(x_adv, y) / WORLD).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", STAGES)
def test_adversarial_input_gradient(stage: int) -> None:
    ref = fgsm_reference()
    for r in run_distributed(fgsm_worker, WORLD, stage):
        assert relative_distance(r, ref) <= TOL, relative_distance(r, ref)


def _generator() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(3, 13), torch.nn.Tanh(), torch.nn.Linear(13, 11))


def _noise(step: int, rank: int) -> torch.Tensor:
    return torch.randn(MB, 3, generator=torch.Generator().manual_seed(100 * step + rank))


REAL, FAKE = 1, 0


def _labels(value: int) -> torch.Tensor:
    return torch.full((MB,), value, dtype=torch.long)


def gan_worker(rank: int, world: int, stage: int) -> dict[str, dict[str, torch.Tensor]]:
    net_d, net_g = make_model(0), _generator()
    eng_d, *_ = zeroshard.initialize(model=net_d, config=_config(stage))
    eng_g, *_ = zeroshard.initialize(model=net_g, config=_config(stage))
    for step in range(STEPS):
        real, _ = _batch(step, rank)
        net_d.zero_grad()  # as the example: clears what the generator's backward left on D
        fake = eng_g(_noise(step, rank))
        eng_d.backward(eng_d(real, _labels(REAL)) + eng_d(fake.detach(), _labels(FAKE)))
        eng_d.step()
        eng_g.backward(eng_d(fake, _labels(REAL)))  # through D: its parameters get gradients too
        eng_g.step()
    out = {"d": gathered_weights(eng_d), "g": gathered_weights(eng_g)}
    eng_d.destroy()
    eng_g.destroy()
    return out


def gan_reference() -> dict[str, dict[str, torch.Tensor]]:
    net_d, net_g = make_model(0), _generator()
    opt_d = torch.optim.AdamW(net_d.parameters(), lr=LR, weight_decay=0.01)
    opt_g = torch.optim.AdamW(net_g.parameters(), lr=LR, weight_decay=0.01)
    for step in range(STEPS):
        net_d.zero_grad()
        fakes = [net_g(_noise(step, r)) for r in range(WORLD)]
        for r, fake in enumerate(fakes):
            real, _ = _batch(step, r)
            ((net_d(real, _labels(REAL)) + net_d(fake.detach(), _labels(FAKE))) / WORLD).backward()
        torch.nn.utils.clip_grad_norm_(net_d.parameters(), CLIP)
        opt_d.step()
        net_g.zero_grad()
        for fake in fakes:
            (net_d(fake, _labels(REAL)) / WORLD).backward()
        torch.nn.utils.clip_grad_norm_(net_g.parameters(), CLIP)
        opt_g.step()
    return {"d": {n: p.detach().clone() for n, p in net_d.named_parameters()},
            "g": {n: p.detach().clone() for n, p in net_g.named_parameters()}}


@pytest.mark.parametrize("stage", STAGES)
def test_gan_with_an_engine_per_model(stage: int) -> None:
    ref = gan_reference()
    for r in run_distributed(gan_worker, WORLD, stage):
        for part in ("d", "g"):
            assert relative_distance(r[part], ref[part]) <= TOL, (part, relative_distance(r[part], ref[part]))


def plain_backward_worker(rank: int, world: int, stage: int) -> str:
    engine, *_ = zeroshard.initialize(model=make_model(0), config=_config(stage))
    engine(*_batch(0, rank)).backward()  # not engine.backward
    try:
        engine.step()
    except zeroshard.ZeroshardError as e:
        return str(e)
    finally:
        engine.destroy()
    return "no error"


@pytest.mark.parametrize("stage", [0, 3])
def test_loss_backward_instead_of_engine_backward_is_an_error(stage: int) -> None:
    for said in run_distributed(plain_backward_worker, WORLD, stage):
        assert "engine.backward" in said and "embed.weight" in said, said
