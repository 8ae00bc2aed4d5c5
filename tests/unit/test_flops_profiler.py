"""The FLOPs profiler (``flops_profiler``), one process: a GPT's forward FLOPs are torch's count and
2·N·tokens, the step profiled is ``profile_step``, the report's layout, depth limit and file, and the
MFU's peak (configured, known, unknown)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import zeroshard
from zeroshard.errors import ConfigError
from zeroshard.profiling import StepProfile
from zeroshard.profiling.peaks import known_peak_tflops, peak_flops

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

BATCH, SEQ = 4, 32
GPT_CFG = GPTConfig(vocab_size=256, block_size=SEQ, n_layer=2, n_head=4, n_embd=64)


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPT_CFG)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, GPT_CFG.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def _train(prof: dict[str, Any], steps: int, ga: int = 1) -> tuple[Any, list[StepProfile | None]]:
    """An engine with the profiler on; the profiler's ``last`` after each optimizer step."""
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": ga,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "flops_profiler": {"enabled": True, **prof}}
    engine, _, _, _ = zeroshard.initialize(model=_gpt(), config=cfg)
    seen = []
    for step in range(steps):
        for micro in range(ga):
            idx = _batch(step * ga + micro)
            engine.backward(engine(idx, idx))
            engine.step()
        seen.append(engine.flops_profiler.last)
    return engine, seen


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, list[StepProfile | None], Path]:
    out = tmp_path_factory.mktemp("prof") / "sub" / "profile.txt"
    engine, seen = _train({"profile_step": 1, "module_depth": 2, "top_modules": 2, "output_file": str(out)}, 3)
    return engine, seen, out


def test_forward_flops_are_torchs_count_and_2_n_tokens(profiled: Any) -> None:
    engine, seen, _ = profiled
    p = seen[1]
    assert p is not None
    model = _gpt()
    idx = _batch(1)
    with FlopCounterMode(display=False) as counter:
        model(idx, idx)
    counts = counter.get_flop_counts()
    assert p.fwd_flops == counter.get_total_flops() > 0
    # Module by module too (ModuleTracker names: GPT.blocks.0.attn).
    by_path = {m.name: m for m in p.model.walk()}
    for name, ops in counts.items():
        if name not in ("Global", "GPT"):
            assert by_path[name.removeprefix("GPT.")].flops == sum(ops.values()), name
    assert by_path["blocks"].flops == by_path["blocks.0"].flops + by_path["blocks.1"].flops  # a container: its sum
    # Forward of a decoder: 2 FLOPs per non-embedding parameter per token, attention aside.
    attn = sum(v for op, v in counts["Global"].items() if "scaled_dot_product" in str(op))
    n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(("wte", "wpe")))
    want = 2 * n * BATCH * SEQ
    assert abs(p.fwd_flops - attn - want) / want < 0.10, (p.fwd_flops, attn, want)


def test_params_and_latencies(profiled: Any) -> None:
    engine, seen, _ = profiled
    p = seen[1]
    assert p is not None
    assert p.model.params == sum(q.numel() for q in engine.module.parameters())
    by_path = {m.name: m for m in p.model.walk()}
    assert by_path["blocks.0.mlp"].params == sum(q.numel() for q in engine.module.blocks[0].mlp.parameters())
    assert 0 < p.fwd_latency < p.iter_latency
    assert 0 < by_path["lm_head"].duration < p.model.duration
    assert p.flops_per_s == pytest.approx(3 * p.fwd_flops / p.iter_latency)
    assert p.mfu is None  # a CPU in fp32: no known peak


def test_only_profile_step_is_profiled(profiled: Any) -> None:
    engine, seen, _ = profiled
    assert seen[0] is None and seen[1] is not None and seen[2] is seen[1]
    assert seen[1].step == 1
    # The timing hooks are gone after the profiled step.
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in engine.module.blocks.modules())


def test_report_layout_depth_and_file(profiled: Any) -> None:
    _, _, out = profiled
    text = out.read_text()
    for line in ("Profile Summary at step 1:", "fwd flops per GPU:", "FLOPS per GPU = 3 * fwd flops per GPU / iter",
                 "MFU = FLOPS per GPU / peak FLOPS per GPU:", "Top 2 modules in terms of params, FLOPs or fwd latency",
                 "depth 2:", "Detailed Profile per GPU", "(blocks): ModuleList(", "(0): Block("):
        assert line in text, line
    assert "depth 3:" not in text and "(attn):" not in text  # module_depth 2: blocks.0 is the deepest shown
    assert "unknown for cpu in float32" in text


def test_accumulation_and_configured_peak() -> None:
    _, seen = _train({"profile_step": 0, "peak_tflops": 2e-5, "detailed": False}, 1, ga=2)
    p = seen[0]
    assert p is not None
    with FlopCounterMode(display=False) as counter:
        _gpt()(_batch(0), _batch(0))
    assert p.fwd_flops == 2 * counter.get_total_flops()  # both micro-steps' forwards
    assert p.peak == pytest.approx(2e7) and p.peak_source == "flops_profiler.peak_tflops"
    assert p.mfu == pytest.approx(p.flops_per_s / 2e7)


def test_known_peaks() -> None:
    assert known_peak_tflops("NVIDIA H200", torch.bfloat16) == 989.4
    assert known_peak_tflops("NVIDIA H100 80GB HBM3", torch.float16) == 989.4
    assert known_peak_tflops("NVIDIA H100 PCIe", torch.bfloat16) == 756.0
    assert known_peak_tflops("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312.0
    assert known_peak_tflops("NVIDIA A100-SXM4-80GB", torch.float32) is None  # TF32 or not: unknown
    assert known_peak_tflops("Tesla T4", torch.float16) is None
    assert peak_flops(None, torch.device("cpu"), torch.bfloat16)[0] is None


def test_unwritable_output_file_names_the_key(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="flops_profiler.output_file"):
        _train({"profile_step": 0, "output_file": str(blocker / "profile.txt")}, 1)
