"""ZeRO-3 on model code as it is written: a forward that reads another module's parameter, in-place
ops on the tensors passed between modules, and evaluation in inference mode.

Real models read parameters outside the module that owns them: a head tied by hand
(``F.linear(h, self.embed.weight)``, nanoGPT-style code without calling the embedding), a
regulariser over a child's weight computed before that child runs, a sibling's norm weight. At
rest a ZeRO-3 parameter is an empty placeholder, and zeroshard gathered units only in their own
module's forward: such reads saw no values (a wrong evaluation without an error) or failed in
backward. torch's own ``nn.MultiheadAttention`` (so ``nn.TransformerEncoderLayer``) is such a
model: it hands ``out_proj.weight`` to its functional form; so is a layer under
``torch.nn.utils.weight_norm``, whose pre-hook computes the weight. DeepSpeed gathers these
parameters on attribute access; so does zeroshard now.

Evaluation under ``torch.inference_mode()`` (``generate()`` in a Hugging Face or TRL loop) made
the units it gathered inference tensors, which the next training step could neither save for
backward nor refill.

ZeRO-3 wraps the tensors passed into and out of a module to know when its backward begins and
ends. The wrappers were views made inside a custom autograd function, which autograd forbids to
modify in place: ``nn.ReLU(inplace=True)`` after a layer or ``h += residual`` (torchvision's and
Hugging Face's ResNets) failed at ZeRO-3 only.

Each run: 2 gloo ranks, ZeRO-3 with every parameter partitioned, 2 steps, a state dict and an
evaluation forward in inference mode, 2 more steps, an evaluation under ``no_grad``; gradient
accumulation 2 and clipping 1.0. Reference: plain PyTorch in one process on the global batch.
Sizes divide by no world size.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from models import gathered_weights, micro_batch, relative_distance, train_reference
from torch import nn

import zeroshard

V, D, SEQ, STEPS, GA, MB, WORLD, LR = 37, 23, 5, 4, 2, 3, 2, 1e-2
GLOBAL = GA * MB * WORLD
FP32_TOL = 1e-5

#: (name, zero_optimization): units released whenever possible, one block's worth live with
#: prefetching, and the default budgets (all gathered after first use: the first reads matter)
SETTINGS = {
    "nothing live": {"stage3_max_live_parameters": 0, "stage3_prefetch_bucket_size": 0},
    "one block live": {"stage3_max_live_parameters": 2 * D * D, "stage3_prefetch_bucket_size": D * D},
    "default budgets": {},
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(self.ln(h)))


class Net(nn.Module):
    """Reads three parameters outside their modules' forwards, the first before its module runs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(D)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        reg = 1e-3 * self.blocks[1].fc.weight.pow(2).sum()  # before blocks[1] runs
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        h = self.ln_f(h) * self.blocks[0].ln.weight  # a sibling's weight, after it ran
        logits = F.linear(h, self.embed.weight)  # the head tied by hand
        return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1)) + reg


class Encoder(nn.Module):
    """torch's own ``TransformerEncoderLayer``: ``MultiheadAttention`` passes ``out_proj.weight`` to
    its functional form without calling ``out_proj``, and the evaluation fast path reads every
    weight of the layer from the layer's forward, which owns none of them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D + 1)  # D + 1 = 24: 4 heads
        # bias=False: the key bias gets a zero gradient (softmax ignores it), which Adam turns
        # into steps of pure rounding noise, different for any summation order
        layer = nn.TransformerEncoderLayer(D + 1, 4, dim_feedforward=41, dropout=0.0, batch_first=True, bias=False)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D + 1, V)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.encoder(self.embed(ids))).reshape(-1, V), y.reshape(-1))


class WeightNormed(nn.Module):
    """``torch.nn.utils.weight_norm`` (Wav2Vec2's and HuBERT's positional convolution): a forward
    pre-hook of the layer computes its weight from two of its parameters before the layer runs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        with warnings.catch_warnings():  # deprecated for torch.nn.utils.parametrizations.weight_norm
            warnings.simplefilter("ignore", FutureWarning)
            self.mid = torch.nn.utils.weight_norm(nn.Linear(D, D))
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(torch.tanh(self.mid(self.embed(ids)))).reshape(-1, V), y.reshape(-1))


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.linspace(0.5, 1.5, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5)  # its input, in place
        return torch.tanh(x) * self.g


class InPlace(nn.Module):
    """In-place ops on what ZeRO-3 hands between modules, as ResNets write them: ``nn.ReLU(inplace=True)``
    on a layer's output, ``h += residual`` on another's, a module scaling its input in place."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.fc1, self.act, self.fc2 = nn.Linear(D, D), nn.ReLU(inplace=True), nn.Linear(D, D)
        self.gate = Gate()
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        residual = self.embed(ids)
        h = self.fc2(self.act(self.fc1(residual)))
        h += residual
        return F.cross_entropy(self.head(self.gate(h)).reshape(-1, V), y.reshape(-1))


MODELS = {"tied by hand": Net, "torch TransformerEncoder": Encoder, "weight_norm": WeightNormed,
          "in-place ops": InPlace}
CASES = [("tied by hand", name) for name in SETTINGS] + [(kind, "nothing live") for kind in list(MODELS)[1:]]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return (torch.randint(0, V, (STEPS, GLOBAL, SEQ), generator=g),
            torch.randint(0, V, (STEPS, GLOBAL, SEQ), generator=g))


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[kind]()


def worker(rank: int, world: int, kind: str, setting: dict[str, Any]) -> dict[str, Any]:
    cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GA, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **setting}}
    engine, *_ = zeroshard.initialize(model=_model(kind), config=cfg)
    x, y = _data()
    out: dict[str, Any] = {}
    for step in range(STEPS):
        if step == STEPS // 2:
            # Save, then evaluate, as a Trainer does: the state dict's explicit gathers hand their
            # tensors out, so the evaluation's gathers make new ones, in inference mode.
            out["saved"] = len(engine.module.state_dict())
            engine.eval()
            with torch.inference_mode():
                out["inference"] = engine.module(x[0], y[0]).item()
            engine.train()
        for m in range(GA):
            engine.backward(engine(*(micro_batch(t, step, m, rank, world, MB) for t in (x, y))))
            engine.step()
    engine.eval()
    with torch.no_grad():
        out["eval"] = engine(x[0], y[0]).item()
    out["weights"] = gathered_weights(engine)
    engine.destroy()
    out["destroyed"] = type(engine.module.embed._parameters).__name__
    return out


@pytest.mark.parametrize(("kind", "name"), CASES)
def test_parameters_read_outside_their_module_train_as_plain_pytorch(kind: str, name: str) -> None:
    results = run_distributed(worker, WORLD, kind, SETTINGS[name])
    x, y = _data()
    half = _model(kind)
    train_reference(half, x[: STEPS // 2], y[: STEPS // 2], LR, 1.0)
    half.eval()
    with torch.no_grad():
        inference = half(x[0], y[0]).item()
    ref = _model(kind)
    train_reference(ref, x, y, LR, 1.0)
    ref.eval()
    with torch.no_grad():
        evaluation = ref(x[0], y[0]).item()
    weights = {n: p.detach() for n, p in ref.named_parameters()}
    for rank, r in enumerate(results):
        dist = relative_distance(r["weights"], weights)
        assert dist <= FP32_TOL, f"{kind}, {name}, rank {rank}: ‖w − w_ref‖/‖w_ref‖ = {dist:.2e}"
        assert r["inference"] == pytest.approx(inference, rel=FP32_TOL), (name, rank, r["inference"], inference)
        assert r["eval"] == pytest.approx(evaluation, rel=FP32_TOL), (name, rank, r["eval"], evaluation)
        assert r["saved"] == len(weights)
        assert r["destroyed"] == "dict", r["destroyed"]  # destroy() gives the module its plain dicts back
