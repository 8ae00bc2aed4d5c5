"""fp16 dynamic loss scaling: an overflow injected on one rank skips the step on every rank.

Also with the optimizer state in host memory or NVMe swap files and (stage 3) the parameter shards
there, as in the fp16 offload configs users copy (``zero3_offload_cpu.json``): a skipped step must
leave the offloaded state as it was.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from models import gathered_weights, make_data, make_model, micro_batch, train_reference_mixed

import zeroshard

STEPS, GA, GLOBAL_BATCH, LR = 6, 2, 16, 1e-2
OVERFLOW_STEP, OVERFLOW_RANK = 2, 1


def _offload(device: str | None, stage: int, nvme: str) -> dict:
    if device is None:
        return {}
    z: dict = {"offload_optimizer": {"device": device, "nvme_path": nvme}, "sub_group_size": 300}
    if stage == 3:
        z["offload_param"] = {"device": device, "nvme_path": nvme}
    return z


def overflow_worker(rank: int, world: int, stage: int, offload: str | None, nvme: str) -> dict:
    x, y = make_data(STEPS, GLOBAL_BATCH)
    micro_bs = GLOBAL_BATCH // (GA * world)
    model = make_model(0)
    cfg = {
        "train_micro_batch_size_per_gpu": micro_bs,
        "gradient_accumulation_steps": GA,
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "initial_scale_power": 10, "hysteresis": 1, "loss_scale_window": 1000},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500, **_offload(offload, stage, nvme)},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
    }
    engine, _, _, _ = zeroshard.initialize(model=model, config=cfg)
    scales, changed, norms = [], [], []
    for step in range(STEPS):
        before = gathered_weights(engine)
        for m in range(GA):
            xb, yb = (micro_batch(t, step, m, rank, world, micro_bs) for t in (x, y))
            loss = engine(xb, yb)
            if step == OVERFLOW_STEP and rank == OVERFLOW_RANK and m == 0:
                loss = loss * float("inf")  # only this rank's gradients become non-finite
            engine.backward(loss)
            engine.step()
        scales.append(engine.cur_scale)
        norms.append(engine.get_global_grad_norm())
        # DeepSpeed's ZeRO optimizers name the scale in use both ways; scripts log either.
        assert engine.optimizer.cur_scale == engine.optimizer.loss_scale == engine.cur_scale
        after = gathered_weights(engine)
        changed.append(any(not torch.equal(before[n], after[n]) for n in after))
    out = {"skipped": engine.skipped_steps, "scales": torch.tensor(scales), "changed": torch.tensor(changed),
           "norms": torch.tensor(norms), "params": gathered_weights(engine)}
    engine.destroy()
    return out


@pytest.mark.parametrize(("stage", "offload"), [(0, None), (1, None), (2, None), (3, None), (1, "cpu"), (2, "nvme"),
                                               (3, "cpu"), (3, "nvme")])
def test_overflow_on_one_rank_skips_everywhere(stage: int, offload: str | None, tmp_path: Path) -> None:
    results = run_distributed(overflow_worker, 2, stage, offload, str(tmp_path))
    x, y = make_data(STEPS, GLOBAL_BATCH)
    skip = frozenset({OVERFLOW_STEP})
    ref = train_reference_mixed(make_model(0), x, y, LR, 1.0, torch.float16, skip_steps=skip)
    w0 = torch.cat([p.detach().reshape(-1) for p in make_model(0).parameters()])
    ref_flat = torch.cat([p.detach().float().reshape(-1) for p in ref.parameters()])
    for r in results:
        assert r["skipped"] == 1
        # Scale halves at the overflow (hysteresis 1) and nowhere else.
        assert r["scales"].tolist() == [1024.0, 1024.0, 512.0, 512.0, 512.0, 512.0]
        assert r["changed"].tolist() == [True, True, False, True, True, True]
        # As DeepSpeed's ZeRO and bf16 optimizers: a skipped step reports an infinite norm (what the
        # HF Trainer logs as grad_norm), not the last applied step's.
        norms = r["norms"].tolist()
        assert norms[OVERFLOW_STEP] == float("inf"), norms
        assert all(math.isfinite(n) and n > 0 for i, n in enumerate(norms) if i != OVERFLOW_STEP), norms
        flat = torch.cat([t.reshape(-1) for t in r["params"].values()])
        # Recovered training equals plain fp16 mixed precision that never saw the overflowing batch
        # (bound as in test_parity's fp16 case: deviation / distance travelled).
        rel = ((flat - ref_flat).norm() / (ref_flat - w0).norm()).item()
        assert rel < 0.005, rel
    assert torch.equal(results[0]["params"]["out.weight"], results[1]["params"]["out.weight"])
