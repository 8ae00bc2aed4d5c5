"""A model compiled with ``torch.compile`` before ``initialize`` trains as plain PyTorch.

zeroshard's message for DeepSpeed's ``engine.compile()`` tells users to do this, yet at ZeRO-3
dynamo traced into the module hooks and their collectives and failed in the first forward
("UnsafeScriptObjectError: Attempted to access unregistered member on an OpaqueObject"). The hooks
(and the gathering of a parameter read outside its module) now run eagerly, a graph break around
each, as DeepSpeed's ZeRO-3 hooks do.

The backend is ``aot_eager``: dynamo's capture and AOT autograd as with the default backend, without
inductor's C++ compilation (minutes on this machine). With inductor the same runs were 2.2e-8 to
3.0e-8 from plain PyTorch at stages 0-3 (a probe, not in CI). 2 gloo ranks, accumulation 2,
clipping 1.0; the model reads parameters outside their modules and changes a module's output in
place.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from models import gathered_weights, make_data, micro_batch, relative_distance, train_reference
from torch import nn

import zeroshard

STEPS, GA, MB, WORLD, LR = 3, 2, 3, 2, 1e-2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.fc, self.ln = nn.Linear(11, 23), nn.Linear(23, 23), nn.LayerNorm(23)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        reg = 1e-3 * self.fc.weight.pow(2).sum()  # before fc runs
        h = self.ln(self.act(self.fc(self.embed(x)))) * self.ln.weight  # in place; ln's weight again
        logits = F.linear(h, self.embed.weight.t())[:, :5]  # a head tied by hand
        return F.cross_entropy(logits, y) + reg


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def worker(rank: int, world: int, stage: int, how: str = "before") -> dict[str, Any]:
    cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GA, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    torch._dynamo.reset()
    if how == "before":
        engine, *_ = zeroshard.initialize(model=torch.compile(_model(), backend="aot_eager"), config=cfg)
    else:  # DeepSpeed's engine.compile(), which accelerate and the HF Trainer call (was NotYetSupportedError)
        engine, *_ = zeroshard.initialize(model=_model(), config=cfg)
        assert not engine.is_compiled
        engine.compile(backend="aot_eager")
        engine.compile(backend="aot_eager")  # a no-op, as in DeepSpeed
        assert engine.is_compiled and engine.module._compiled_call_impl is not None
    x, y = make_data(STEPS, GA * MB * world)
    for step in range(STEPS):
        for m in range(GA):
            engine.backward(engine(*(micro_batch(t, step, m, rank, world, MB) for t in (x, y))))
            engine.step()
    return {n.removeprefix("_orig_mod."): t for n, t in gathered_weights(engine).items()}


@pytest.mark.parametrize("stage,how", [(0, "before"), (2, "before"), (3, "before"), (1, "engine.compile"),
                                       (3, "engine.compile")])
def test_compiled_model_trains_as_plain_pytorch(stage: int, how: str) -> None:
    x, y = make_data(STEPS, GA * MB * WORLD)
    want = {n: p.detach() for n, p in train_reference(_model(), x, y, LR, 1.0).named_parameters()}
    for rank, got in enumerate(run_distributed(worker, WORLD, stage, how)):
        dist = relative_distance(got, want)
        assert dist <= 1e-5, f"stage {stage}, rank {rank}: ‖w − w_ref‖/‖w_ref‖ = {dist:.2e}"
