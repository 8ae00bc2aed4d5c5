"""The training report and the CSV monitor on CUDA/NCCL (skipped without CUDA; CI has none).

One process, world size 1 over NCCL, ZeRO-2 and ZeRO-3: the report line carries the device's
allocator figures, the wall-clock breakdown (with ZeRO-3's gather time), tokens/s from integer
inputs, and the CSV monitor holds every step's loss at x = global samples, equal to the loss the
loop saw. Run on a GPU machine with ``python3 -m pytest -q tests/gpu``.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import pytest
import torch

import zeroshard

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("stage", [2, 3])
def test_report_and_csv_on_cuda(stage: int, tmp_path: Path) -> None:
    zeroshard.init_distributed()
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("zeroshard").addHandler(handler)
    logging.getLogger("zeroshard").setLevel(logging.INFO)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
        cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "steps_per_print": 2,
               "wall_clock_breakdown": True, "zero_optimization": {"stage": stage},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}}
        engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        assert engine.device.type == "cuda"
        losses = []
        for _ in range(4):
            ids = torch.randint(0, 64, (4, 8), device=engine.device)
            loss = torch.nn.functional.cross_entropy(engine(ids).flatten(0, 1).float(), ids.flatten())
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    finally:
        logging.getLogger("zeroshard").removeHandler(handler)
    lines = [r for r in records if r.startswith("step=")]
    assert len(lines) == 2, records
    assert "device=n/a" not in lines[1] and "GiB (peak" in lines[1].split("device=")[1]
    assert "tokens/s=" in lines[1] and "ms/step: forward=" in lines[1]
    assert ("gather=" in lines[1]) == (stage == 3)
    with open(tmp_path / "job" / "Train_Samples_train_loss.csv", newline="") as f:
        rows = list(csv.reader(f))[1:]
    assert [int(s) for s, _ in rows] == [4, 8, 12, 16]
    torch.testing.assert_close(torch.tensor([float(v) for _, v in rows]), torch.tensor(losses), rtol=1e-6, atol=0)
