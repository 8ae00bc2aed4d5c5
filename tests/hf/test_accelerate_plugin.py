"""accelerate's ``DeepSpeedPlugin(zero_stage=2, offload_param_device="cpu", offload_optimizer_device="cpu")``:
the config it writes (an ``offload_param`` block at stage 2, which DeepSpeed accepts and ignores) trains on
zeroshard with gradient accumulation to plain PyTorch's parameters. Until #48 it was refused
(``ConfigError: ... parameter offload requires ZeRO stage 3``) and the script never trained."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate", reason="accelerate is not installed (pip install 'zeroshard[hf]')")

import plugin_workers as W  # noqa: E402
from harness import run_distributed  # noqa: E402


@pytest.mark.parametrize("world", [2])
def test_accelerate_plugin_with_offload_param_at_stage2_matches_plain_pytorch(world: int) -> None:
    results = run_distributed(W.plugin_worker, world, timeout=300)
    ref = W.reference(world)
    for r in results:
        assert r["written"]["stage"] == 2 and r["written"]["offload_param"]["device"] == "cpu"  # what users send
        assert (r["offload_param"], r["offload_optimizer"]) == ("none", "cpu")  # what runs: as in DeepSpeed
        assert (r["steps"], r["gas"], r["clip"]) == (W.STEPS, W.ACCUM, W.CLIP)
        for name, p in ref.items():
            got = r["params"][name]
            rel = ((got - p).norm() / p.norm()).item()
            assert rel <= 1e-5, (name, rel)
    assert torch.equal(results[0]["params"]["0.weight"], results[1]["params"]["0.weight"])
