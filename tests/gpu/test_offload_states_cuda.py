"""``engine.offload_states()`` / ``reload_states()`` on CUDA: the device memory goes and comes back.

One process over NCCL, ZeRO stages 1-3, bf16, with and without ``offload_optimizer: cpu``. After each
boundary backward every state goes to host memory (page-locked) and comes back: the device's
``memory_allocated()`` drops by at least the bytes the engine says it moved (each buffer is rounded up to
the allocator's blocks, and ZeRO-3 releases gathered units first) and regains them on reload, the states
are reported on the CPU meanwhile, and the trained parameters are bit-identical to a run that never
offloads (the same kernels run on the same values). ``benchmarks/gpu.sh offload_states`` prints the
figures per state name on a larger model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import make_data, make_model

import zeroshard
from zeroshard.deepspeed.offload_states import get_state_devices
from zeroshard.deepspeed.utils import safe_get_full_fp32_param

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

STEPS, GA, BATCH, LR = 4, 2, 24, 1e-2


@pytest.fixture(scope="module", autouse=True)
def nccl() -> None:
    zeroshard.init_distributed()


def _train(stage: int, opt: str, offload: bool) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    dev = torch.device("cuda")
    x, y = (t.to(dev) for t in make_data(STEPS, BATCH))
    z: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 600, "stage3_param_persistence_threshold": 0}
    if opt != "none":
        z["offload_optimizer"] = {"device": opt}
    cfg = {"train_batch_size": BATCH, "gradient_accumulation_steps": GA, "gradient_clipping": 1.0,
           "bf16": {"enabled": True}, "zero_optimization": z,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}}
    engine, _, _, _ = zeroshard.initialize(model=make_model(0), config=cfg)
    mb = BATCH // GA
    seen = []
    for step in range(STEPS):
        for m in range(GA):
            engine.backward(engine(x[step, m * mb : (m + 1) * mb], y[step, m * mb : (m + 1) * mb]))
            if offload and m == GA - 1:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                engine.offload_states()
                after = torch.cuda.memory_allocated()
                states = engine.optimizer.offloaded_states
                devices = {s.value: {d.type for d in get_state_devices(engine, s)} for s in states}
                pinned = all(t.is_pinned() for st in engine.optimizer.optimizer.state.values()
                             for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
                moved = engine.optimizer.state_mover.moved_bytes
                engine.reload_states(non_blocking=True)
                back = torch.cuda.memory_allocated()
                seen.append({"moved": moved, "dropped": before - after, "regained": back - after,
                             "devices": devices, "pinned": pinned, "step": step})
            engine.step()
    weights = [safe_get_full_fp32_param(p).float().cpu() for p in engine.module.parameters()]  # type: ignore[union-attr]
    engine.destroy()
    return weights, seen


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("opt", ["none", "cpu"])
def test_offload_states_frees_the_device_and_training_is_unchanged(stage: int, opt: str) -> None:
    ref, _ = _train(stage, opt, offload=False)
    weights, seen = _train(stage, opt, offload=True)
    for s in seen:
        print(f"cuda offload_states stage {stage} optimizer {opt}: {s}")
        assert s["moved"] > 0 and s["dropped"] >= s["moved"], s
        assert s["regained"] >= s["moved"], s
        assert all(d <= {"cpu"} for d in s["devices"].values()), s
        if opt == "none" and s["step"] > 0:  # the optimizer has state after the first step
            assert s["pinned"], s
    assert all(torch.equal(a, b) for a, b in zip(weights, ref)), f"stage {stage}: offload changed the training"
