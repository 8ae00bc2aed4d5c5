"""Fine-tuning with frozen parameters (LoRA, adapters), at every stage and with offload.

The base weights of each layer are frozen (``requires_grad=False``); low-rank adapters, a norm and
a bias train. Scripts pass either the trainable parameters (``filter(lambda p: p.requires_grad,
...)``, as PEFT recipes do) or ``model.parameters()`` whole. Reference: one process of plain
PyTorch over the global batch, AdamW over the trainable parameters, clipping their norm. The
frozen parameters must come out bit-identical, the rest within fp32 reduction noise. Sizes are odd
so that no parameter divides evenly between the ranks.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from harness import log_lines, run_distributed
from models import gathered_weights
from torch import nn

import zeroshard

D, RANK, OUT, STEPS, GA, MB, LR = 67, 5, 11, 6, 2, 3, 1e-2
WORLD = 2
TOL = 1e-5

#: (name, zero_optimization, pass every parameter to initialize, built under zero.Init: None (no),
#: "device" (its default) or a ``remote_device``)
CASES: list[tuple[str, dict[str, Any], bool, str | None]] = [
    ("stage 0", {"stage": 0}, False, None),
    ("stage 1", {"stage": 1}, False, None),
    ("stage 2", {"stage": 2}, False, None),
    ("stage 2, all parameters passed", {"stage": 2}, True, None),
    ("stage 3", {"stage": 3, "stage3_param_persistence_threshold": 0}, False, None),
    ("stage 3, all parameters passed", {"stage": 3, "stage3_param_persistence_threshold": 0}, True, None),
    ("stage 3, small units persistent", {"stage": 3}, False, None),
    ("stage 1, optimizer on CPU", {"stage": 1, "offload_optimizer": {"device": "cpu"}}, False, None),
    ("stage 2, optimizer on NVMe", {"stage": 2, "sub_group_size": 100, "offload_optimizer": {"device": "nvme"}},
     False, None),
    ("stage 3, optimizer and parameters on CPU", {"stage": 3, "stage3_param_persistence_threshold": 0,
                                                   "offload_optimizer": {"device": "cpu"},
                                                   "offload_param": {"device": "cpu"}}, False, None),
    ("stage 3, optimizer and parameters on NVMe", {"stage": 3, "stage3_param_persistence_threshold": 0,
                                                    "sub_group_size": 100, "offload_optimizer": {"device": "nvme"},
                                                    "offload_param": {"device": "nvme"}}, True, None),
    # transformers' from_pretrained under ZeRO-3, then PEFT freezing the base: frozen parameters
    # arrive partitioned by zero.Init (their forward crashed on the empty placeholders)
    ("stage 3, built under zero.Init", {"stage": 3, "stage3_param_persistence_threshold": 0}, False, "device"),
    ("stage 3, built under zero.Init, parameters on NVMe", {"stage": 3, "stage3_param_persistence_threshold": 0,
                                                           "offload_param": {"device": "nvme"}}, True, "nvme"),
]


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update ``B @ A``."""

    def __init__(self, fan_in: int, fan_out: int) -> None:
        super().__init__()
        self.base = nn.Linear(fan_in, fan_out)
        self.A = nn.Parameter(torch.randn(RANK, fan_in) * 0.1)
        self.B = nn.Parameter(torch.randn(fan_out, RANK) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.A), self.B)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(D, D)  # frozen, and the first module: nothing flows back past it
        self.l1 = LoRALinear(D, 3 * D)
        self.norm = nn.LayerNorm(3 * D)
        self.l2 = LoRALinear(3 * D, D)
        self.head = nn.Linear(D, OUT)  # weight frozen, bias trained: one unit, half frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.emb(x))
        g = F.gelu(self.norm(self.l1(h)))
        return self.head(h + self.l2(g))


def trains(name: str) -> bool:
    return name.endswith((".A", ".B")) or name.startswith("norm.") or name == "head.bias"


def build(zero_init: str | None = None) -> Net:
    torch.manual_seed(0)
    if zero_init is None:
        m = Net()
    else:
        with zeroshard.zero.Init(remote_device=None if zero_init == "device" else zero_init):
            m = Net()
    for n, p in m.named_parameters():
        p.requires_grad_(trains(n))
    return m


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    n = STEPS * GA * MB * WORLD
    return torch.randn(n, D, generator=g), torch.randint(0, OUT, (n,), generator=g)


def reference() -> dict[str, torch.Tensor]:
    m = build()
    x, y = data()
    trained = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=LR, weight_decay=0.01)
    per = GA * MB * WORLD
    for s in range(STEPS):
        opt.zero_grad()
        for j in range(GA * WORLD):  # the mean over the global batch
            rows = slice(s * per + j * MB, s * per + (j + 1) * MB)
            (F.cross_entropy(m(x[rows]), y[rows]) / (GA * WORLD)).backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def _train(rank: int, world: int, nvme: str) -> dict[str, Any]:
    warnings = log_lines(logging.WARNING)
    x, y = data()
    per = GA * MB * world
    out: dict[str, Any] = {}
    for name, zero, pass_all, zero_init in CASES:
        zero = {k: dict(v, nvme_path=nvme) if isinstance(v, dict) else v for k, v in zero.items()}
        cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GA, "gradient_clipping": 1.0,
               "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
               "zero_optimization": zero}
        m = build(zero_init)
        params = m.parameters() if pass_all else [p for p in m.parameters() if p.requires_grad]
        warnings.clear()
        engine, *_ = zeroshard.initialize(model=m, model_parameters=params, config=cfg)
        said = [w for w in warnings if "frozen parameter" in w]
        for s in range(STEPS):
            for g in range(GA):
                rows = slice(s * per + (g * world + rank) * MB, s * per + (g * world + rank + 1) * MB)
                engine.backward(F.cross_entropy(engine(x[rows]), y[rows]))
                engine.step()
        out[name] = {"weights": gathered_weights(engine), "warned": said}
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def frozen_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    nvme = tmp_path_factory.mktemp("nvme")
    return {"ranks": run_distributed(_train, WORLD, str(nvme)), "ref": reference(), "nvme": Path(nvme)}


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_frozen_parameters_train_as_plain_torch(case: str, frozen_results: dict[str, Any]) -> None:
    ref = frozen_results["ref"]
    initial = dict(build().named_parameters())
    for rank, result in enumerate(frozen_results["ranks"]):
        w = result[case]["weights"]
        assert set(w) == set(ref), f"rank {rank}: parameter names differ"
        for n in ref:
            if not trains(n):
                assert torch.equal(w[n], initial[n].detach()), f"rank {rank}: frozen {n} changed"
        trained = [n for n in ref if trains(n)]
        num = sum(float((w[n] - ref[n]).norm() ** 2) for n in trained) ** 0.5
        den = sum(float(ref[n].norm() ** 2) for n in trained) ** 0.5
        moved = sum(float((ref[n] - initial[n].detach()).norm() ** 2) for n in trained) ** 0.5
        assert moved > 100 * TOL * den, "the reference barely trained: the check would prove nothing"
        assert num / den <= TOL, f"rank {rank}: ‖w − w_ref‖/‖w_ref‖ = {num / den:.2e}"


def test_stage3_says_frozen_parameters_stay_whole(frozen_results: dict[str, Any]) -> None:
    """ZeRO-3 does not partition frozen parameters yet: initialize says so, with the bytes."""
    frozen_bytes = sum(p.numel() * 4 for n, p in build().named_parameters() if not trains(n))
    for name, zero, _, _ in CASES:
        warned = frozen_results["ranks"][0][name]["warned"]
        if zero["stage"] == 3:
            assert len(warned) == 1 and f"{frozen_bytes / 2**20:.1f} MiB" in warned[0], (name, warned)
        else:
            assert not warned, (name, warned)
    assert not any(frozen_results["nvme"].iterdir()), "swap files were left behind"
