"""Client optimizers whose update depends on a parameter's shape are refused, elementwise ones train
exactly (one process, a world of one).

zeroshard steps flat 1-D master views at every stage, so ``torch.optim.Adafactor`` passed to
``initialize`` trained silently differently from plain PyTorch (0.97% of the weights' norm after 5
steps here, stage 0 and 2 alike) and ``torch.optim.Muon`` failed inside the first step.
"""

from __future__ import annotations

import functools

import pytest
import torch

import zeroshard
from zeroshard.errors import ConfigError, NotYetSupportedError


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0, "zero_optimization": {"stage": stage}}


class Adafactor(torch.optim.SGD):
    """Stands for transformers' ``Adafactor``: another module, the same name."""


class MyAdafactor(torch.optim.Adafactor):
    """A user's subclass of a shape-dependent optimizer."""


class LAMB8bit(torch.optim.SGD):
    """Stands for bitsandbytes' ``LAMB8bit``: a family matched by part of the name."""


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("make", [
    pytest.param(lambda m: torch.optim.Adafactor(m.parameters(), lr=1e-2), id="torch-Adafactor"),
    pytest.param(lambda m: Adafactor(m.parameters(), lr=1e-2), id="Adafactor-by-name"),
    pytest.param(lambda m: functools.partial(torch.optim.Adafactor, lr=1e-2), id="partial"),
    pytest.param(lambda m: MyAdafactor(m.parameters(), lr=1e-2), id="subclass"),
    pytest.param(lambda m: LAMB8bit(m.parameters(), lr=1e-2), id="family"),
    pytest.param(lambda m: torch.optim.Muon([p for p in m.parameters() if p.ndim == 2], lr=1e-2), id="Muon"),
    pytest.param(lambda m: (lambda groups: Adafactor(groups, lr=1e-2)), id="factory"),
])
def test_shape_dependent_client_optimizer_is_refused(stage: int, make, process_group: None) -> None:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    refused = r"(Adafactor|Muon|LAMB8bit)( \(a Adafactor\))? is not supported yet: .* shape"
    with pytest.raises(NotYetSupportedError, match=refused) as info:
        zeroshard.initialize(model=model, optimizer=make(model), config=_config(stage))
    assert info.value.key == "optimizer"
    if stage == 3:  # refused before partitioning, except a factory, known only once it has built one
        factory = not isinstance(make(model), (torch.optim.Optimizer, functools.partial))
        assert factory or all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_a_factory_failing_on_flat_views_says_so(process_group: None) -> None:
    """``torch.optim.Muon`` refuses anything but 2-D tensors when it is built: from a factory it is
    built over zeroshard's 1-D views, and the error says that is why."""
    with pytest.raises(ConfigError, match=r"Muon only supports 2D parameters.*flat 1-D views") as info:
        zeroshard.initialize(model=_model(), optimizer=lambda groups: torch.optim.Muon(groups, lr=1e-2),
                             config=_config(2))
    assert info.value.key == "optimizer"


@pytest.mark.parametrize("stage", [0, 2])
def test_elementwise_client_optimizer_matches_plain_pytorch(stage: int, process_group: None) -> None:
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model = _model()
    engine, *_ = zeroshard.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=_config(stage))
    for i in range(5):
        x, y = _batch(i)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    initial = list(_model().parameters())
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), initial)) > 1e-3  # it trained
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
    engine.destroy()


def test_a_factory_raising_a_zeroshard_error_keeps_its_type(process_group: None) -> None:
    """An error that already says what it is (here the config builder's own refusal) passes through."""
    from zeroshard.optim import build_optimizer

    with pytest.raises(NotYetSupportedError, match="'Lamb' is not supported yet"):
        zeroshard.initialize(model=_model(), optimizer=lambda groups: build_optimizer("Lamb", {}, groups),
                             config=_config(2))
