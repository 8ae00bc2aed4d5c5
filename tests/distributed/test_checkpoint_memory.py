"""Consolidation streams: converting a checkpoint far larger than a memory budget stays under it.

A 1-rank job saves a 192 MiB model (48 fp32 tensors of 4 MiB; no optimizer step, so masters only).
A fresh subprocess imports zeroshard, resets its peak-RSS mark (``/proc/self/clear_refs``), runs
``zeroshard convert`` and reports its peak resident memory above the starting point: it must stay
under 64 MiB, a third of the model and 16 times the largest tensor (a generous margin; the
benchmark reports the real figure). As a control, the same measurement around
``get_fp32_state_dict_from_zero_checkpoint``, which by design returns the whole model, must see
the model's full size, so the measurement would catch a conversion that held everything.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from harness import run_distributed

import zeroshard

LAYERS, WIDTH = 48, 1024
MODEL_BYTES = LAYERS * WIDTH * WIDTH * 4
BUDGET = 64 * 2**20


def big_model() -> torch.nn.Module:
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(float(i))
    return model


def save_worker(rank: int, world: int, root: str) -> None:
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = zeroshard.initialize(model=big_model(), config=cfg)
    engine.save_checkpoint(root)


MEASURE = """
import json, sys, torch
import zeroshard
from zeroshard.cli.main import main

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

def measure(fn):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current resident size
    start = status("VmRSS")
    result = fn()
    return status("VmHWM") - start, result

ckpt, out = sys.argv[1], sys.argv[2]
convert, code = measure(lambda: main(["convert", ckpt, out, "-q"]))
state_dict, sd = measure(lambda: zeroshard.get_fp32_state_dict_from_zero_checkpoint(ckpt))
print(json.dumps({"convert": convert, "code": code, "state_dict": state_dict, "tensors": len(sd)}))
"""


def test_convert_streams_under_budget(tmp_path: Path) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "model.safetensors"
    run_distributed(save_worker, 1, str(ckpt))
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(ckpt), str(out)], capture_output=True, text=True,
                          timeout=300, check=True)
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"model {MODEL_BYTES / 2**20:.0f} MiB; peak RSS above start: convert {m['convert'] / 2**20:.1f} MiB, "
          f"full state dict {m['state_dict'] / 2**20:.1f} MiB")
    assert m["code"] == 0 and m["tensors"] == LAYERS
    assert m["state_dict"] > 0.9 * MODEL_BYTES, "control: holding the whole model must show in the measurement"
    assert m["convert"] < BUDGET, f"conversion peaked {m['convert'] / 2**20:.0f} MiB above its start"
    assert out.stat().st_size > MODEL_BYTES
    from safetensors import safe_open

    with safe_open(str(out), framework="pt") as f:
        assert len(f.keys()) == LAYERS
        for i in (0, LAYERS - 1):
            t = f.get_tensor(f"{i}.weight")
            assert t.shape == (WIDTH, WIDTH) and bool((t == float(i)).all())
