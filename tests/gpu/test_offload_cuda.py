"""Offload on CUDA: masters and optimizer state in host memory or NVMe files, the step on the CPU.

One process, world size 1 over NCCL. Each offload choice trains the toy model and is compared with
the in-memory run of the same stage on the GPU. They are not bit-identical here (unlike on a
CPU-only machine): the in-memory step runs torch's fused CUDA AdamW, the offloaded one its fused
CPU AdamW, whose roundings differ in the last bit; the figures are printed and bounded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models import make_data, make_model

import zeroshard
from zeroshard.deepspeed.utils import safe_get_full_fp32_param

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

STEPS, GA, BATCH, LR = 6, 2, 24, 1e-2
#: fp32: last-bit differences of two AdamW kernels over 6 steps; bf16: those flip a few 16-bit
#: roundings of the published weights, whose gradients then differ slightly.
TOL = {"fp32": 1e-6, "bf16": 2e-3}


@pytest.fixture(scope="module", autouse=True)
def nccl() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    zeroshard.init_distributed()


def _train(stage: int, precision: str, opt: str, param: str, nvme: Path,
           ratio: float = 1.0) -> tuple[list[torch.Tensor], dict]:
    dev = torch.device("cuda")
    x, y = (t.to(dev) for t in make_data(STEPS, BATCH))
    z: dict = {"stage": stage, "reduce_bucket_size": 600, "sub_group_size": 700,
               "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 500}
    if opt != "none":
        z["offload_optimizer"] = {"device": opt, "nvme_path": str(nvme), "ratio": ratio}
    if param != "none":
        z["offload_param"] = {"device": param, "nvme_path": str(nvme), "buffer_size": 10_000}
    cfg = {"train_batch_size": BATCH, "gradient_accumulation_steps": GA, "gradient_clipping": 1.0,
           "bf16": {"enabled": precision == "bf16"}, "zero_optimization": z,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}}
    engine, _, _, _ = zeroshard.initialize(model=make_model(0), config=cfg)
    mb = BATCH // GA
    for step in range(STEPS):
        for m in range(GA):
            engine.backward(engine(x[step, m * mb : (m + 1) * mb], y[step, m * mb : (m + 1) * mb]))
            engine.step()
    weights = [safe_get_full_fp32_param(p).float().cpu() for p in engine.module.parameters()]  # type: ignore[union-attr]
    placement = engine.optimizer.memory_placement()
    engine.destroy()
    return weights, placement


#: (stage, optimizer offload, parameter offload[, offload_optimizer.ratio])
CASES: list[tuple] = [(1, "cpu", "none"), (1, "nvme", "none"), (2, "cpu", "none"), (2, "nvme", "none"),
                      (3, "cpu", "none"), (3, "nvme", "none"), (3, "cpu", "cpu"), (3, "nvme", "nvme"),
                      (3, "none", "cpu"),
                      # partial offload: of the 3 sub-groups (units of 444 + 74, 1102, 150 elements at 700),
                      # int((1 - 0.5) * 3) = 1 stays on the GPU
                      (3, "cpu", "none", 0.5), (3, "cpu", "cpu", 0.5)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_offload_matches_in_memory(precision: str, tmp_path: Path) -> None:
    refs = {s: _train(s, precision, "none", "none", tmp_path)[0] for s in (1, 2, 3)}
    worst = {}
    for stage, opt, param, *ratio in CASES:
        weights, placement = _train(stage, precision, opt, param, tmp_path, *ratio)
        rel = max(float((a - b).norm() / b.norm()) for a, b in zip(weights, refs[stage]))
        worst[(stage, opt, param, *ratio)] = rel
        print(f"cuda {precision} stage {stage} optimizer {opt} params {param} {ratio}: {rel:.2e} {placement}")
        if opt == "cpu" and not ratio:
            assert "device" not in placement["optimizer_states"], placement
        if ratio:  # the kept sub-group's masters and state on the GPU, the others in host memory
            for kind in ("master_weights", "optimizer_states"):
                assert placement[kind].get("device", 0) > 0, placement
                assert placement[kind].get("host", 0) + placement[kind].get("pinned_host", 0) > 0, placement
    assert max(worst.values()) <= TOL[precision], worst
