"""``engine.offload_states()`` / ``reload_states()`` (DeepSpeed's, as RLHF frameworks call them) on 2 gloo ranks.

For ZeRO stages 1, 2 and 3 (DeepSpeed has them at these stages only; stage 0 is refused, see
``tests/unit/test_state_moves.py``), fp32 and bf16: a run that offloads and reloads after every
backward (mid-window and at the boundary) reaches bit-identical parameters to a run that never
offloads (``torch.equal``). It offloads everything (``include=None``) at the first and the last two
micro-steps, and each of DeepSpeed's five names alone in between, through the engine and through
``engine.optimizer`` as OpenRLHF does, with and without ``pin_memory`` and ``non_blocking``, and
each name twice (the second call moves nothing); one micro-step's forward and backward run with
the optimizer state (and the masters) offloaded. The model has a frozen layer (ZeRO-3 partitions
it: its chunks move with ``lp_params``) and, at ZeRO-3, a persistent unit.

On the CPU the training device is the host, so what is checked is what the move does rather than
where bytes end up: every storage of the state is replaced (each old one is freed, ``StorageWeakRef``
expires: no alias was left holding it, which on an accelerator is the device memory handed back,
``benchmarks/gpu.sh offload_states`` measures it), the aliases the core relies on survive (fp32
masters inside the parameters at stages 1-2; DeepSpeed's ``ds_tensor`` and the units' rows inside the
master buffer at stage 3), a ZeRO-3 forward while offloaded gives the same outputs, and
``offloaded_states``, ``get_state_devices`` and ``memory_placement()`` say what is offloaded.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import zeroshard
from zeroshard.core.state_moves import StateKind
from zeroshard.deepspeed.offload_states import get_state_devices
from zeroshard.deepspeed.utils import safe_get_full_fp32_param

DIM, HID, OUT, STEPS, GA, MB, LR, CLIP = 13, 37, 5, 4, 2, 3, 1e-2, 0.05
NAMES = ["optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, HID)
        self.frozen = nn.Linear(HID, HID)
        self.b = nn.Linear(HID, HID)
        self.c = nn.Linear(HID, OUT)  # 190 elements: persistent at ZeRO-3 (threshold 200)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h)) + self.frozen(h)
        return self.c(h)


def _config(stage: int, dtype: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GA, "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 600, "allgather_bucket_size": 900,
                              "stage3_param_persistence_threshold": 200},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _storages(engine: Any) -> list[StorageWeakRef]:
    """Weak references to every storage of the engine's state (every kind, every view)."""
    mover = engine.optimizer.state_mover
    return [StorageWeakRef(t.untyped_storage()) for k in StateKind for t in mover.tensors(k)
            if t.untyped_storage().nbytes() > 0]


def _check_offloaded(engine: Any, stage: int, dtype: str, x: torch.Tensor) -> dict[str, Any]:
    """Offload everything and reload it, checking what can be checked on the CPU on the way."""
    mover = engine.optimizer.state_mover
    expected = mover.bytes_on_device(StateKind)  # what offloading every kind frees on the device
    before = _storages(engine)
    with torch.no_grad():
        out_before = engine(x) if stage == 3 else None
    engine.offload_states()
    seen: dict[str, Any] = {"left_behind": sum(not r.expired() for r in before), "storages": len(before),
                            "moved": mover.moved_bytes, "expected": expected,
                            "offloaded": sorted(s.value for s in engine.optimizer.offloaded_states),
                            "devices": {n: sorted(str(d) for d in get_state_devices(engine, n)) for n in NAMES},
                            "placement": engine.optimizer.memory_placement()}
    opt = engine.optimizer
    if stage < 3 and dtype == "fp32":  # the masters are views of the parameters, still
        seen["masters_in_params"] = all(m.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
                                        for p, m in opt.master.views.items())
    if stage == 3:
        flat = opt.master.flat.untyped_storage().data_ptr()
        seen["ds_tensor_in_masters"] = all(p.ds_tensor.untyped_storage().data_ptr() == flat
                                           for p in engine.module.parameters() if p.requires_grad)
        seen["units_in_masters"] = all(u.shard.untyped_storage().data_ptr() == flat for u in opt.units)
        with torch.no_grad():
            seen["forward_same"] = bool(torch.equal(engine(x), out_before))
    offloaded = _storages(engine)
    engine.reload_states()
    engine.reload_states()  # nothing left to bring back
    seen["left_behind_reload"] = sum(not r.expired() for r in offloaded)
    seen["offloaded_after_reload"] = sorted(s.value for s in engine.optimizer.offloaded_states)
    return seen


def _train(cfg: dict[str, Any], rank: int, world: int, stage: int, offload: bool) -> tuple[list[torch.Tensor],
                                                                                          list[dict[str, Any]]]:
    g = torch.Generator().manual_seed(1)
    n = STEPS * GA * MB * world
    x, y = torch.randn(n, DIM, generator=g), torch.randn(n, OUT, generator=g)
    torch.manual_seed(0)
    model = Net()
    engine, *_ = zeroshard.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=cfg)
    dtype = "bf16" if "bf16" in cfg else "fp32"
    checks = []
    turn = 0
    for step in range(STEPS):
        for m in range(GA):
            i = ((step * GA + m) * world + rank) * MB
            out = engine(x[i : i + MB])
            engine.backward(F.mse_loss(out.float(), y[i : i + MB]))
            if offload and turn in (0, STEPS * GA - 1):  # everything, with the checks
                engine.reload_states()  # what the turn before left offloaded
                checks.append(_check_offloaded(engine, stage, dtype, x[:MB]))
            elif offload and turn == STEPS * GA - 2:
                engine.offload_states()
                engine.reload_states()
                # The next micro-step's forward and backward run with the optimizer state away (and
                # the masters, where they are not the parameters of stages 1-2), as DeepSpeed allows.
                away = ["optim_states"] + (["hp_params"] if stage == 3 or dtype == "bf16" else [])
                engine.offload_states(include=away)
            elif offload:  # each of DeepSpeed's names in turn (mid-window and at the boundary)
                name = NAMES[(turn - 1) % len(NAMES)]
                # OpenRLHF calls the optimizer's method; the engine's checks then come first
                target = engine.optimizer if turn % 2 else engine
                target.offload_states(include=[name], pin_memory=bool(turn % 3), non_blocking=bool(turn % 2))
                target.offload_states(include=[name])  # already offloaded: nothing more
                assert engine.optimizer.offloaded_states, name
                target.reload_states(non_blocking=not turn % 2)
            turn += 1
            engine.step()
    weights = [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters() if p.requires_grad]
    engine.destroy()
    return weights, checks


def offload_states_worker(rank: int, world: int, stage: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dtype in ("fp32", "bf16"):
        cfg = _config(stage, dtype)
        ref, _ = _train(cfg, rank, world, stage, offload=False)
        weights, checks = _train(cfg, rank, world, stage, offload=True)
        out[dtype] = (all(torch.equal(a, b) for a, b in zip(weights, ref)), checks)
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_and_reload_leave_training_bit_identical(stage: int) -> None:
    results = run_distributed(offload_states_worker, 2, stage, timeout=400)
    for rank, result in enumerate(results):
        for run, (same, checks) in result.items():
            assert same, f"rank {rank}, stage {stage}, {run}: the parameters differ from the run without offload"
            for seen in checks:
                where = f"rank {rank}, stage {stage}, {run}"
                assert seen["storages"] > 0
                assert seen["left_behind"] == 0, f"{where}: an old storage is still held: {seen}"
                assert seen["left_behind_reload"] == 0, f"{where}: a host storage is still held: {seen}"
                assert seen["moved"] == seen["expected"] > 0, where
                assert seen["offloaded"] == sorted(NAMES) and seen["offloaded_after_reload"] == [], where
                assert seen["devices"]["contiguous_grad_buffer"] == [], where  # freed after each backward
                for name in ("optim_states", "hp_params", "lp_params", "lp_grads"):
                    assert seen["devices"][name] in (["cpu"], []), (where, name)
                assert seen["devices"]["lp_params"] == ["cpu"], where
                assert set(seen["placement"]["gradients"]) <= {"host"}, where
                if stage < 3:
                    assert sum(seen["placement"]["parameters"].values()) > 0, where
                for key in ("masters_in_params", "ds_tensor_in_masters", "units_in_masters", "forward_same"):
                    assert seen.get(key, True), f"{where}: {key}"
            if checks:  # the last ones are after optimizer steps: the optimizer has state by then
                assert checks[-1]["devices"]["optim_states"] == ["cpu"], (rank, run)
