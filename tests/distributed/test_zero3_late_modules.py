"""Found by re-running DeepSpeed's own unit tests against zeroshard (issue #48), on 2 gloo ranks:

* a module attached to a ZeRO-3 engine's model after ``initialize`` (an adapter, a head, a LoRA layer
  added later) ran with whole, ordinary parameters that got gradients and were never updated (they
  are in no unit and not in the optimizer; DeepSpeed does the same): now a trainable one is refused
  where it is attached, with an error naming it, and a frozen one runs as in DeepSpeed, its parameter
  dict a gathering one (DeepSpeed's ``TestZero3LateModuleAttach``);
* ``param.ds_summary()``, DeepSpeed's per-parameter debugging summary that its tests print in their
  messages, was missing on ZeRO-3 parameters (``'Parameter' object has no attribute 'ds_summary'``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import run_distributed
from models import ToyNet, make_data, micro_batch

import zeroshard

WORLD, MB = 2, 3


def _config() -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MB, "gradient_clipping": 0.0,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


class _WithHead(torch.nn.Module):
    """ToyNet's logits through an optional ``head`` attached later."""

    def __init__(self) -> None:
        super().__init__()
        self.body = ToyNet()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        net = self.body
        h = torch.nn.functional.gelu(net.norm(net.embed(x)))
        logits = net.out(torch.tanh(net.hidden(h)))
        if hasattr(self, "head"):
            logits = self.head(logits)
        return torch.nn.functional.cross_entropy(logits, y)


def _late(rank: int, world: int) -> dict[str, Any]:
    from zeroshard.deepspeed.param_offload import ZeROOrderedDict

    torch.manual_seed(0)
    model = _WithHead()
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=_config())
    x, y = make_data(2, MB * world)
    out: dict[str, Any] = {}
    head = torch.nn.Linear(5, 5)
    try:
        engine.module.body.head2 = head  # anywhere in the tree: named by its path
    except zeroshard.ZeroshardError as e:
        out["nested"] = str(e)
    try:
        engine.module.head = head
    except zeroshard.ZeroshardError as e:
        out["refused"] = str(e)
    out["attached"] = hasattr(engine.module, "head") or hasattr(engine.module.body, "head2")
    engine.module.body.out = engine.module.body.out  # a managed module put back: accepted
    head.requires_grad_(False)  # a frozen one runs, as in DeepSpeed
    engine.module.head = head
    before = head.weight.detach().clone()
    losses = []
    for step in range(2):
        loss = engine(micro_batch(x, step, 0, rank, world, MB), micro_batch(y, step, 0, rank, world, MB))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    out["frozen_unchanged"] = torch.equal(before, head.weight.detach())
    out["gathering_dict"] = isinstance(head._parameters, ZeROOrderedDict)
    out["losses"] = losses
    engine.destroy()
    return out


def test_module_attached_after_initialize() -> None:
    for result in run_distributed(_late, WORLD, timeout=120):
        for key, path in (("refused", "head"), ("nested", "body.head2")):
            message = result[key]
            assert f"module '{path}' (Linear) is attached to the engine's model after initialize" in message
            assert "weight, bias" in message and "before deepspeed.initialize" in message
            assert "requires_grad_(False)" in message
        assert not result["attached"]
        assert result["frozen_unchanged"] and result["gathering_dict"]
        assert all(torch.isfinite(torch.tensor(result["losses"])))


def _summary(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = ToyNet()
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=_config())
    x, y = make_data(1, MB * world)
    weight = engine.module.hidden.weight
    at_rest = weight.ds_summary()
    engine.backward(engine(micro_batch(x, 0, 0, rank, world, MB), micro_batch(y, 0, 0, rank, world, MB)))
    engine.step()
    with zeroshard.zero.GatheredParameters([weight]):
        gathered = weight.ds_summary(use_debug_name=True)
    out = {"at_rest": at_rest, "gathered": gathered, "ds_id": weight.ds_id}
    engine.destroy()
    return out


@pytest.mark.parametrize("world", [WORLD])
def test_ds_summary(world: int) -> None:
    """DeepSpeed's keys and values: the full shape in ``ds_shape``/``ds_numel``, the parameter as it is
    now in ``shape``/``numel``, this rank's padded partition in ``ds_tensor.shape``."""
    for result in run_distributed(_summary, world, timeout=120):
        rest, gathered = result["at_rest"], result["gathered"]
        assert set(rest) == {"id", "status", "numel", "ds_numel", "shape", "ds_shape", "requires_grad", "grad_shape",
                             "persist", "active_sub_modules", "ds_tensor.shape"}
        assert rest["id"] == result["ds_id"] and rest["status"] == "NOT_AVAILABLE"
        assert rest["ds_shape"] == (29, 37) and rest["ds_numel"] == 29 * 37 and rest["numel"] == 0
        assert rest["requires_grad"] and rest["persist"] is False
        assert tuple(rest["ds_tensor.shape"]) == (-(-29 * 37 // world),)
        assert gathered["status"] == "AVAILABLE" and gathered["shape"] == (29, 37) and gathered["numel"] == 29 * 37
        assert gathered["id"].endswith(f"id={result['ds_id']}")
