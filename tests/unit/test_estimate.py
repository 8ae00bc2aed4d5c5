"""Memory estimator and planner: DeepSpeed's functions, zeroshard's residency, activations, the CLI.

All single-process. What is compared with what:

- DeepSpeed's ``estimate_zero{2,3}_*`` (numbers and printed tables) against DeepSpeed 0.19's own
  functions when importable, and against the formulas transcribed from its source always;
- zeroshard's model-state estimate against ``engine.memory_usage()["total"]`` of a real GPT
  (``examples/gpt.py``) at every stage, bf16 and fp32, world size 1 (within 10%; measured exact up
  to Adam's step counters);
- the activation estimate against two measurements of one forward with autograd on, on CPU: the
  bytes of the tensors autograd saves (``saved_tensors_hooks``, each storage once, parameters
  excluded) plus the logits, and the peak RSS growth of the forward in a subprocess (glibc's mmap
  threshold fixed so that freed tensors leave the RSS, the peak reset through /proc/self/clear_refs),
  also with a checkpoint per block — within 25% (measured: 1.3% or better);
- the planner's chosen config is loaded by ``zeroshard.initialize`` and trains;
- the offload residency (``estimate.residency``) against hand-computed bytes for a 4000-parameter
  model on 4 ranks, and against ``engine.optimizer.memory_placement()`` of real engines with NVMe
  optimizer (and parameter) offload at stages 1–3, world size 1 (exact, swap-file padding included);
- the planner choosing CPU offload when the GPU is too small, NVMe when host memory is too small
  too (with ``--nvme-gb``/``--nvme-path``); the configs it writes load, and the NVMe one trains.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.config import load_config
from zeroshard.errors import ConfigError
from zeroshard.estimate import formulas
from zeroshard.estimate.activations import estimate_activations
from zeroshard.estimate.hf import spec_from_hf_config
from zeroshard.estimate.model_spec import (
    ModelSpec,
    TransformerShape,
    parse_count,
    spec_from_count,
    spec_from_module,
)
from zeroshard.estimate.planner import Hardware, PlanError, Training, estimate, plan, zeroshard_row
from zeroshard.estimate.residency import Offload, placement
from zeroshard.estimate.states import model_states

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

SMALL = GPTConfig(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=256)


def _gpt_shape(cfg: GPTConfig) -> TransformerShape:
    return TransformerShape(hidden_size=cfg.n_embd, num_layers=cfg.n_layer, num_heads=cfg.n_head,
                            num_kv_heads=cfg.n_head, head_dim=cfg.n_embd // cfg.n_head,
                            intermediate_size=4 * cfg.n_embd, vocab_size=cfg.vocab_size, max_positions=cfg.block_size)


def _printed(fn: Any, *args: Any) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fn(*args)
    return out.getvalue()


# ---------------------------------------------------------------- DeepSpeed's functions

# (total_params, largest_layer_params, gpus per node, nodes, additional_buffer_factor)
CASES = [
    (7_000_000_000, 131_072_000, 8, 1, 1.5),
    (7e9, 1e8, 8, 2, 1.5),
    (124_439_808, 38_597_376, 1, 1, 1.5),
    (70_553_706_496, 1_050_673_152, 8, 4, 1.0),
    (1_000_003, 333_333, 3, 5, 2.0),
    (13e9, 2.5e8, 2, 1, 1.5),
]


def _zero2_formula(psi: float, gpn: int, nodes: int, offload: bool, f: float) -> tuple[int, int]:
    """DeepSpeed 0.19, runtime/zero/stage_1_and_2.py, transcribed."""
    gpus = gpn * nodes
    if offload:
        return int(psi * max(4 * gpus, 16) * f), int(2 * psi)
    return int(psi * 4 * gpn * f), int(2 * psi + int(18 * psi / gpus))


def _zero3_formula(psi: float, big: float, gpn: int, nodes: int, opt: bool, par: bool, init: bool,
                   f: float) -> tuple[int, int]:
    """DeepSpeed 0.19, runtime/zero/stage3.py, transcribed."""
    gpus, per_node = gpn * nodes, 1 / nodes
    if opt and par:
        gpu = 4 * big
        cpu = psi * 18 * per_node * f if init else psi * max(4 * gpn, 18 * per_node) * f
    elif opt:
        gpu = 4 * big + int(2 * psi / gpus)
        cpu = psi * 16 * per_node * f if init else psi * max(4 * gpn, 16 * per_node) * f
    else:
        gpu = 4 * big + int(18 * psi / gpus)
        cpu = big * 4 * gpn * f if init else psi * 4 * gpn * f
    return int(cpu), int(gpu)


@pytest.mark.parametrize("case", CASES)
def test_formulas_match_deepspeed_source(case: tuple) -> None:
    psi, big, gpn, nodes, f = case
    for offload in (True, False):
        assert formulas.estimate_zero2_model_states_mem_needs(psi, gpn, nodes, offload, f) == \
            _zero2_formula(psi, gpn, nodes, offload, f)
    for opt, par, init in formulas.zero3_options():
        cpu, gpu, largest = formulas.estimate_zero3_model_states_mem_needs(psi, big, gpn, nodes, opt, par, init, f)
        assert (cpu, gpu) == _zero3_formula(psi, big, gpn, nodes, opt, par, init, f)
        assert largest == 4 * big
    assert len(formulas.zero3_options()) == 6  # DeepSpeed's six rows, offload_param only with offload_optimizer


def _deepspeed() -> Any:
    try:
        from deepspeed.runtime.zero import stage3, stage_1_and_2
    except Exception:  # not installed, or fails to import on this machine
        pytest.skip("deepspeed is not importable")
    return stage_1_and_2, stage3


def _normalize(text: str) -> str:
    # DeepSpeed formats OffloadDeviceEnum.cpu with ':4', which Python >= 3.11 renders as the member name.
    return text.replace("OffloadDeviceEnum.cpu", "cpu ")


@pytest.mark.parametrize("case", CASES)
def test_same_numbers_and_tables_as_deepspeed(case: tuple) -> None:
    ds2, ds3 = _deepspeed()
    psi, big, gpn, nodes, f = case
    for offload in (True, False):
        assert formulas.estimate_zero2_model_states_mem_needs(psi, gpn, nodes, offload, f) == \
            ds2.estimate_zero2_model_states_mem_needs(psi, gpn, nodes, offload, f)
    for opt, par, init in formulas.zero3_options():
        assert formulas.estimate_zero3_model_states_mem_needs(psi, big, gpn, nodes, opt, par, init, f) == \
            ds3.estimate_zero3_model_states_mem_needs(psi, big, gpn, nodes, opt, par, init, f)
    assert _printed(formulas.estimate_zero2_model_states_mem_needs_all_cold, psi, gpn, nodes, f) == \
        _normalize(_printed(ds2.estimate_zero2_model_states_mem_needs_all_cold, psi, gpn, nodes, f))
    assert _printed(formulas.estimate_zero3_model_states_mem_needs_all_cold, psi, big, gpn, nodes, f) == \
        _normalize(_printed(ds3.estimate_zero3_model_states_mem_needs_all_cold, psi, big, gpn, nodes, f))


def test_all_live_matches_deepspeed_on_a_real_model() -> None:
    ds2, ds3 = _deepspeed()
    model = GPT(GPTConfig(vocab_size=300, n_layer=3, n_embd=64, tie_weights=True))
    assert formulas.zero3_model_to_params(model) == ds3.model_to_params(model)
    assert formulas.zero2_model_to_params(model) == ds2.model_to_params(model) == model.num_parameters()
    for args in ((model,), (model, 8, 2)):
        assert _printed(formulas.estimate_zero2_model_states_mem_needs_all_live, *args) == \
            _normalize(_printed(ds2.estimate_zero2_model_states_mem_needs_all_live, *args))
        assert _printed(formulas.estimate_zero3_model_states_mem_needs_all_live, *args) == \
            _normalize(_printed(ds3.estimate_zero3_model_states_mem_needs_all_live, *args))


def test_printed_table_format() -> None:
    text = _printed(formulas.estimate_zero3_model_states_mem_needs_all_cold, 7e9, 1e8, 8, 2)
    assert text.splitlines() == [
        "Estimated memory needed for params, optim states and gradients for a:",
        "HW: Setup with 2 nodes, 8 GPUs per node.",
        "SW: Model with 7000M total params, 100M largest layer params.",
        "  per CPU  |  per GPU |   Options",
        "   88.01GB |   0.37GB | offload_param=cpu , offload_optimizer=cpu , zero_init=1",
        "  312.92GB |   0.37GB | offload_param=cpu , offload_optimizer=cpu , zero_init=0",
        "   78.23GB |   1.19GB | offload_param=none, offload_optimizer=cpu , zero_init=1",
        "  312.92GB |   1.19GB | offload_param=none, offload_optimizer=cpu , zero_init=0",
        "    4.47GB |   7.71GB | offload_param=none, offload_optimizer=none, zero_init=1",
        "  312.92GB |   7.71GB | offload_param=none, offload_optimizer=none, zero_init=0",
    ]


def test_meta_models_count_shared_parameters_once() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=300, n_layer=2, n_embd=64, tie_weights=True))
    real = GPT(GPTConfig(vocab_size=300, n_layer=2, n_embd=64, tie_weights=True))
    assert formulas.zero3_model_to_params(model) == formulas.zero3_model_to_params(real)


def test_deepspeed_import_paths() -> None:
    from zeroshard.deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold, model_to_params
    from zeroshard.deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_live

    assert estimate_zero2_model_states_mem_needs_all_live is formulas.estimate_zero2_model_states_mem_needs_all_live
    assert estimate_zero3_model_states_mem_needs_all_cold is formulas.estimate_zero3_model_states_mem_needs_all_cold
    assert model_to_params is formulas.zero3_model_to_params
    ds = zeroshard  # `import zeroshard as deepspeed`
    assert ds.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs is \
        formulas.estimate_zero2_model_states_mem_needs
    assert ds.estimate_zero3_model_states_mem_needs_all_live is formulas.estimate_zero3_model_states_mem_needs_all_live


def test_estimator_import_does_not_import_torch() -> None:
    code = ("import sys, zeroshard\n"
            "zeroshard.estimate_zero2_model_states_mem_needs_all_cold(7e9, 8)\n"
            "from zeroshard.deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold\n"
            "assert 'torch' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stderr
    assert "offload_optimizer=cpu" in proc.stdout


# ---------------------------------------------------------------- model specs


# Parameter counts published for these checkpoints (Hugging Face model cards / safetensors metadata).
HF_CONFIGS = {
    "gpt2": ({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257}, 124_439_808),
    "llama-2-7b": ({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "vocab_size": 32000}, 6_738_415_616),
    "mistral-7b": ({"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
                    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                    "vocab_size": 32000}, 7_241_732_096),
    "qwen2-0.5b": ({"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                    "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                    "tie_word_embeddings": True}, 494_032_768),
    "pythia-160m": ({"model_type": "gpt_neox", "hidden_size": 768, "intermediate_size": 3072,
                     "num_hidden_layers": 12, "num_attention_heads": 12, "vocab_size": 50304}, 162_322_944),
    "llama-3-70b": ({"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                     "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256}, 70_553_706_496),
}


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_builtin_families_count_like_transformers(name: str, tmp_path: Path) -> None:
    cfg, want = HF_CONFIGS[name]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = spec_from_hf_config(tmp_path, use_transformers=False)  # a directory holding config.json
    assert spec.total_params == want
    assert spec.transformer is not None and spec.units is not None
    assert sum(spec.units) == want == sum(spec.param_numels or ())


def test_transformers_and_builtin_agree() -> None:
    pytest.importorskip("transformers")
    for cfg, want in HF_CONFIGS.values():
        a, b = spec_from_hf_config(cfg, use_transformers=True), spec_from_hf_config(cfg, use_transformers=False)
        assert a.total_params == b.total_params == want
        assert (a.units, a.largest_layer_params, a.transformer) == (b.units, b.largest_layer_params, b.transformer)


def test_bad_hf_configs_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown model_type 'nonsense'"):
        spec_from_hf_config('{"model_type": "nonsense", "hidden_size": 8}')
    with pytest.raises(ConfigError, match="no 'model_type'"):
        spec_from_hf_config({"hidden_size": 8})
    with pytest.raises(ConfigError, match="missing 'num_hidden_layers'"):
        spec_from_hf_config({"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 10},
                            use_transformers=False)
    with pytest.raises(ConfigError, match="invalid JSON"):
        spec_from_hf_config("{not json")
    with pytest.raises(ConfigError, match="does not exist"):
        spec_from_hf_config(tmp_path / "missing.json")


def test_parse_count() -> None:
    assert [parse_count(t) for t in ("7e9", "7B", "125M", "1.3b", "1000")] == [7e9, 7e9, 125e6, 1.3e9, 1000]
    for bad in ("seven", "0", "-5", "7X"):
        with pytest.raises(ConfigError, match="--params"):
            parse_count(bad)
    assert spec_from_count(1000).largest_assumed
    with pytest.raises(ConfigError, match="--largest-layer"):
        spec_from_count(1000, 2000)


# ---------------------------------------------------------------- model states vs memory_breakdown


def _train_one_step(model: nn.Module, config: dict[str, Any], steps: int = 1) -> tuple[Any, list[float]]:
    engine, *_ = zeroshard.initialize(model=model, config=config)
    torch.manual_seed(1)
    data = torch.randint(0, model.config.vocab_size, (config["train_micro_batch_size_per_gpu"], 33))
    losses = []
    for _ in range(steps):
        loss = engine(data[:, :-1].contiguous(), data[:, 1:].contiguous())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_model_states_match_memory_breakdown(dtype: str) -> None:
    with torch.device("meta"):
        spec = spec_from_module(GPT(SMALL), "gpt")
    assert spec.units and max(spec.units) > 100_000 > min(spec.units)  # both gathered and persistent ZeRO-3 units
    for stage in range(4):
        torch.manual_seed(0)
        config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 1.0}
        if dtype == "bf16":
            config["bf16"] = {"enabled": True}
        engine, _ = _train_one_step(GPT(SMALL), config)
        measured = engine.memory_usage()
        est = model_states(spec, stage, 1, dtype)
        assert abs(est.total - measured["total"]) <= 0.10 * measured["total"], (stage, est.breakdown, measured)
        for key, value in est.breakdown.items():  # key by key, up to Adam's step counters
            assert abs(value - measured[key]) <= 1024, (stage, key, value, measured[key])
        assert est.workspace == measured["comm_workspace"]
        if stage == 3:
            assert est.gathered == measured["gathered_peak"]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_model_states_follow_zero_formulas(world: int) -> None:
    # The same formulas tests/distributed/test_memory.py checks memory_usage() against on 2 and 4 ranks.
    with torch.device("meta"):
        spec = spec_from_module(GPT(SMALL), "gpt")
    psi, tensors = spec.total_params, len(spec.param_numels or ())
    for stage in range(4):
        shard = 1 if stage == 0 else world
        want = {"gradients": 4 * psi / (world if stage >= 2 else 1), "master_weights": 4 * psi / shard,
                "optimizer_states": 8 * psi / shard}
        got = model_states(spec, stage, world, "bf16").breakdown
        for key, value in want.items():
            assert value <= got[key] <= value + 4 * world * tensors, (stage, key)


# ---------------------------------------------------------------- activations


def _saved_bytes(model: nn.Module, idx: torch.Tensor) -> int:
    """Bytes autograd saves in one forward (each storage once, parameters excluded), plus the logits."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    logits: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    hook = model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o.numel() * o.element_size()))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    hook.remove()
    return sum(saved.values()) + sum(logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_match_saved_tensors(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = GPT(SMALL).to(dtype)
    batch, seq = 4, 128
    measured = _saved_bytes(model, torch.randint(0, SMALL.vocab_size, (batch, seq)))
    est = estimate_activations(_gpt_shape(SMALL), batch, seq, dtype.itemsize)
    # In bf16 the estimate also counts the fp32 copy of the logits cross_entropy makes (alive at the
    # peak, never saved); in fp32 there is none.
    assert abs(est.total - measured) <= 0.25 * measured, (est, measured)
    if dtype == torch.float32:
        assert abs(est.total - measured) <= 0.01 * measured, (est.total, measured)
    assert est.checkpointed < est.total


_RSS_SCRIPT = """
import gc, sys
import torch
from torch.utils.checkpoint import checkpoint
sys.path.insert(0, {examples!r})
from gpt import GPT, GPTConfig
torch.set_num_threads(1)
dtype = getattr(torch, sys.argv[1])
model = GPT(GPTConfig(vocab_size=4096, block_size=512, n_layer=4, n_head=8, n_embd=512)).to(dtype)
idx = torch.randint(0, 4096, (4, 512))
model(idx[:1, :64], idx[:1, :64]).backward()  # warm-up: thread pools, allocator
for p in model.parameters():
    p.grad = None
gc.collect()


def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
except OSError:
    sys.exit(3)
base = status("VmRSS")
before = status("VmHWM")
loss = model(idx, idx)
peak = status("VmHWM")
del loss
gc.collect()
# The same forward with one checkpoint per block: only the blocks' inputs stay.
for block in model.blocks:
    block.forward = (lambda f: lambda x: checkpoint(f, x, use_reentrant=False))(block.forward)
model(idx, idx)  # warm-up: the first checkpointed forward allocates caches once
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
ckpt_base = status("VmRSS")
loss = model(idx, idx)
print(base, before, peak, ckpt_base, status("VmHWM"))
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_activations_match_peak_rss_growth(dtype: str) -> None:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _RSS_SCRIPT.format(examples=str(ROOT / "examples")), dtype],
                          capture_output=True, text=True, timeout=120, env=env)
    if proc.returncode == 3:
        pytest.skip("cannot reset the peak RSS (/proc/self/clear_refs)")
    assert proc.returncode == 0, proc.stderr
    base, before, peak, ckpt_base, ckpt_peak = map(int, proc.stdout.split())
    assert before - base < 2**20 and peak > before, (base, before, peak)
    cfg = GPTConfig(vocab_size=4096, block_size=512, n_layer=4, n_head=8, n_embd=512)
    est = estimate_activations(_gpt_shape(cfg), 4, 512, 4 if dtype == "float32" else 2)
    assert abs(est.total - (peak - base)) <= 0.25 * (peak - base), (est.total, peak - base)
    # Checkpointed, the forward keeps the layers' inputs and the head; the one-layer recompute
    # that completes est.checkpointed happens in backward.
    forward_part = est.checkpointed - est.per_layer
    assert abs(forward_part - (ckpt_peak - ckpt_base)) <= 0.25 * (ckpt_peak - ckpt_base), \
        (forward_part, ckpt_peak - ckpt_base)


def test_activation_formula_components() -> None:
    shape = _gpt_shape(SMALL)
    act = estimate_activations(shape, 2, 64, 2)
    assert act.total == act.num_layers * act.per_layer + act.head
    assert act.checkpointed == act.num_layers * act.layer_input + act.per_layer + act.head
    assert act.layer_input == 2 * 64 * 2 * SMALL.n_embd
    eager = estimate_activations(shape, 2, 64, 2, attention="eager")
    assert eager.per_layer > act.per_layer  # the s^2 softmax
    doubled = estimate_activations(shape, 4, 64, 2)
    assert doubled.total == 2 * act.total  # linear in the micro batch
    with pytest.raises(ValueError, match="attention"):
        estimate_activations(shape, 1, 1, 2, attention="flash3")


# ---------------------------------------------------------------- table, planner, CLI


def _estimate_cli(*args: str) -> tuple[int, str, str]:
    from zeroshard.cli.estimate import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse errors
            code = int(e.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_estimate_table_for_a_hf_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIGS["llama-2-7b"][0]))
    code, out, err = _estimate_cli(str(tmp_path), "--gpus", "8", "--seq-len", "4096")
    assert code == 0, err
    assert "6.74B parameters" in out and "largest layer 131.07M (model.embed_tokens)" in out
    assert "activations per GPU (micro batch 1 x 4096 tokens" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[1].strip() + "/" + r.split("|")[2].strip() for r in rows] == [
        "0/none", "1/none", "1/optimizer->cpu", "1/optimizer->nvme", "2/none", "2/optimizer->cpu",
        "2/optimizer->nvme", "3/none", "3/optimizer->cpu", "3/optimizer->nvme", "3/optimizer+params->cpu",
        "3/optimizer+params->nvme"]
    nvme = [r.split("|")[8].strip() for r in rows]  # NVMe per node: only the NVMe rows have swap files
    assert [n != "-" for n in nvme] == ["nvme" in r for r in rows]
    assert "not yet" not in out and "DeepSpeed's numbers" not in out


def test_estimate_params_and_deepspeed_tables() -> None:
    code, out, _ = _estimate_cli("--params", "7e9", "--gpus", "8", "--deepspeed")
    assert code == 0
    assert "activations: unknown" in out and "assumed: 5% of the parameters" in out
    assert "SW: Model with 7000M total params." in out and "offload_param=cpu" in out


def test_estimate_factory_on_meta_device(tmp_path: Path) -> None:
    factory = tmp_path / "factory.py"
    factory.write_text("import torch\n"
                       "def build():\n"
                       "    assert torch.empty(1).device.type == 'meta'\n"
                       "    return torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 10))\n"
                       "def broken():\n"
                       "    raise RuntimeError('boom')\n")
    code, out, err = _estimate_cli(f"{factory}:build")
    assert code == 0, err
    assert "1.01M parameters" in out and "activations: unknown" in out
    code, _, err = _estimate_cli(f"{factory}:broken")
    assert code == 2 and "cannot build the model" in err and "boom" in err
    code, _, err = _estimate_cli(f"{factory}:missing")
    assert code == 2 and "no attribute 'missing'" in err
    code, _, err = _estimate_cli("no_such_module_xyz:build")
    assert code == 2 and "cannot import 'no_such_module_xyz'" in err


@pytest.mark.parametrize("args, message", [
    (["--params", "7e9", "--gpu-memory", "80"], "--gpu-memory: '80' has no unit"),
    (["--params", "7e9", "--gpu-memory", "0GB"], "--gpu-memory: 0GB is not a plausible size"),
    (["--params", "7e9", "--gpu-memory", "1KB"], "is not a plausible size"),
    (["--params", "7e9", "--gpu-memory", "lotsGB"], "cannot read size"),
    (["--params", "7e9", "--gpu-memory", "80GB", "--cpu-memory", "-1GB"], "--cpu-memory"),
    (["--params", "7e9", "--cpu-memory", "512GB"], "only used with --gpu-memory"),
    (["--params", "7e9", "--gpus", "0"], "--gpus: must be at least 1"),
    (["--params", "lots"], "--params"),
    (['{"model_type": "nonsense"}'], "unknown model_type 'nonsense'"),
    ([], "give MODEL"),
])
def test_estimate_errors(args: list[str], message: str) -> None:
    code, _, err = _estimate_cli(*args)
    assert code == 2 and message in err and "Traceback" not in err, err


def test_planner_chooses_cpu_offload_when_the_gpu_is_too_small(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    # 14 GB: the bf16 parameters (13.04 GiB) leave no room for stage 2. At 16 GB stage 2 fits (its
    # all-gather buffers are the gather outputs, two of half allgather_bucket_size), and is chosen.
    code, text, err = _estimate_cli("--params", "7e9", "--gpus", "8", "--gpu-memory", "16GB", "--cpu-memory",
                                    "512GB", "-o", str(tmp_path / "c16.json"))
    assert code == 0, err
    assert "chosen: ZeRO stage 2, offload optimizer->cpu" in text
    code, text, err = _estimate_cli("--params", "7e9", "--gpus", "8", "--gpu-memory", "14GB", "--cpu-memory",
                                    "512GB", "-o", str(out))
    assert code == 0, err
    assert "chosen: ZeRO stage 3, offload optimizer->cpu" in text
    config = load_config(out, world_size=8)
    assert config.zero_optimization.offload_optimizer.device == "cpu"
    assert config.zero_optimization.offload_param.device == "none"
    # Host memory too small for CPU offload, and no NVMe budget: the error says NVMe would fit.
    code, _, err = _estimate_cli("--params", "7e9", "--gpus", "8", "--gpu-memory", "16GB", "--cpu-memory", "100GB",
                                 "-o", str(tmp_path / "none.json"))
    assert code == 1 and not (tmp_path / "none.json").exists()
    assert "no configuration fits" in err and "With NVMe offload it would fit" in err and "--nvme-gb" in err
    # 32 GB: NVMe offload would fit (its host memory is the build's 15.65 GiB since the gradient
    # shard spills to a file-backed buffer: it was above 32 GB before)
    code, _, err = _estimate_cli("--params", "7e9", "--gpus", "8", "--gpu-memory", "16GB", "--cpu-memory", "32GB")
    assert code == 1 and "With NVMe offload it would fit" in err and "15.65 GiB of CPU memory" in err, err
    # 12 GB: not even that; on 16 GPUs ZeRO-3 would fit the GPUs, but not the build's host memory
    code, _, err = _estimate_cli("--params", "7e9", "--gpus", "8", "--gpu-memory", "16GB", "--cpu-memory", "12GB")
    assert code == 1 and "on 16 GPUs ZeRO-3 would fit in GPU memory" in err, err


def test_planner_prefers_fast_configs() -> None:
    spec = spec_from_hf_config(HF_CONFIGS["llama-2-7b"][0], use_transformers=False)
    hw = Hardware(8, 1, 80 * 10**9, 512 * 10**9)
    chosen = plan(spec, hw, Training(micro_batch=1, seq_len=4096))
    assert chosen.row.stage == 2 and not chosen.checkpointing  # stages 0-1 do not fit 7B on 80 GB
    longer = plan(spec, hw, Training(micro_batch=8, seq_len=4096))
    assert longer.checkpointing  # 8 sequences of 4096 tokens need activation checkpointing
    assert any("gradient_checkpointing_enable" in n for n in longer.notes)
    little_cpu = plan(spec, Hardware(8, 1, 80 * 10**9, 128 * 10**9), Training(micro_batch=1, seq_len=4096))
    assert little_cpu.row.stage == 3  # 8 processes building a 7B model in fp32 need more CPU memory
    one_gpu = plan(spec, Hardware(1, 1, 24 * 10**9), Training(micro_batch=1, seq_len=4096))
    assert one_gpu.row.choice.optimizer == "cpu"  # 7B on one 24 GB GPU: only with the optimizer on the CPU
    with pytest.raises(PlanError, match="no configuration fits"):
        plan(spec, Hardware(1, 1, 4 * 10**9, 64 * 10**9), Training(micro_batch=1, seq_len=4096))


def test_estimate_rows_are_consistent() -> None:
    spec = spec_from_hf_config(HF_CONFIGS["gpt2"][0], use_transformers=False)
    est = estimate(spec, Hardware(4, 2), Training(micro_batch=2, seq_len=1024))
    by = {(r.stage, r.offload): r for r in est.rows}
    assert est.activations is not None
    assert all(r.activations == est.activations.total for r in est.rows)
    # sharding only ever lowers the model states
    states = [by[(s, "none")].model_states for s in range(4)]
    assert states == sorted(states, reverse=True)
    # With the optimizer on the CPU, stage 2 keeps only the 16-bit parameters on the GPU: DeepSpeed's 2Ψ too.
    _, gpu = formulas.estimate_zero2_model_states_mem_needs(spec.total_params, 4, 2, True)
    assert by[(2, "optimizer->cpu")].model_states == gpu
    for r in est.rows:  # rows without offload: the placement's device bytes are the memory_usage() total
        assert r.source == "zeroshard" and r.placement is not None
        if r.offload == "none":
            assert r.states is not None and r.model_states == r.states.total
        assert (r.nvme_per_node > 0) == r.choice.uses_nvme


def _budget_for(spec: Any, hw: Hardware, stage: int) -> int | None:
    """A GPU memory size for which ``stage`` is the planner's first fit, if one exists."""
    totals = [zeroshard_row(spec, hw, Training(), s).gpu_total() for s in range(4)]
    if any(totals[s] <= totals[stage] for s in range(stage)):
        return None
    gap = min([totals[s] for s in range(stage)], default=2 * totals[stage])
    return int((totals[stage] + gap) / 2 / 0.9)


@pytest.mark.parametrize("want_stage", [0, 3])
def test_planned_config_trains(tmp_path: Path, want_stage: int) -> None:
    factory = tmp_path / "factory.py"
    factory.write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'examples')!r})\n"
                       "from gpt import GPT, GPTConfig\n"
                       "def build():\n"
                       f"    return GPT(GPTConfig(vocab_size={SMALL.vocab_size}, block_size={SMALL.block_size}, "
                       f"n_layer={SMALL.n_layer}, n_head={SMALL.n_head}, n_embd={SMALL.n_embd}))\n")
    from zeroshard.estimate.model_spec import spec_from_factory

    spec = spec_from_factory(f"{factory}:build")
    hw = Hardware(8, 1)
    budget = _budget_for(spec, hw, want_stage)
    assert budget is not None
    out = tmp_path / "ds_config.json"
    code, text, err = _estimate_cli(f"{factory}:build", "--gpus", "8", "--gpu-memory", f"{budget}B", "--micro-batch",
                                    "4", "-o", str(out))
    assert code == 0, err
    assert f"chosen: ZeRO stage {want_stage}" in text and f"wrote {out}" in text
    config = json.loads(out.read_text())
    assert config["zero_optimization"]["stage"] == want_stage and config["bf16"] == {"enabled": True}
    torch.manual_seed(0)
    _, losses = _train_one_step(GPT(SMALL), config, steps=4)
    assert losses[-1] < losses[0]


# ---------------------------------------------------------------- offload


# Ψ = 4000 in two parameters (3000 and 1000), each its own ZeRO-3 unit; on N = 4 ranks every
# rank's shard is S = 750 + 250 = 1000 elements (no padding). bf16 (c = 2), fp32 accumulation (a = 4).
TINY = ModelSpec("tiny", 4000, 3000, param_numels=(3000, 1000), units=(3000, 1000), unit_param_counts=(1, 1))
_F = 4096  # one swap-file region: 1000 fp32 elements, rounded up to a 4096-byte block
_BY_HAND = {
    # (stage, optimizer, params): {kind: {place: bytes}} per rank
    (1, "cpu", "none"): {"parameters": {"device": 2 * 4000}, "gradients": {"device": 4 * 4 * 1000},
                         "master_weights": {"pinned_host": 4 * 1000}, "optimizer_states": {"host": 8 * 1000}},
    (2, "cpu", "none"): {"parameters": {"device": 2 * 4000}, "gradients": {"pinned_host": 4 * 1000},
                         "master_weights": {"pinned_host": 4 * 1000}, "optimizer_states": {"host": 8 * 1000}},
    (3, "cpu", "none"): {"parameter_shard": {"device": 2 * 1000}, "gradients": {"pinned_host": 4 * 1000},
                         "master_weights": {"pinned_host": 4 * 1000}, "optimizer_states": {"host": 8 * 1000}},
    (3, "cpu", "cpu"): {"parameter_shard": {"pinned_host": 2 * 1000}, "gradients": {"pinned_host": 4 * 1000},
                        "master_weights": {"pinned_host": 4 * 1000}, "optimizer_states": {"host": 8 * 1000}},
    # NVMe: one sub-group of 1000 elements, so one buffer slot of 1000 fp32 per file (master + 2 moments)
    (1, "nvme", "none"): {"parameters": {"device": 2 * 4000}, "gradients": {"device": 4 * 4 * 1000},
                          "parameter_shard": {"device": 2 * 1000}, "master_weights": {"file": _F},
                          "optimizer_states": {"file": 2 * _F, "pinned_host": 1000 * 4 * 3}},
    (2, "nvme", "none"): {"parameters": {"device": 2 * 4000}, "gradients": {"file": 4 * 1000},
                          "parameter_shard": {"device": 2 * 1000}, "master_weights": {"file": _F},
                          "optimizer_states": {"file": 2 * _F, "pinned_host": 1000 * 4 * 3}},
    (3, "nvme", "none"): {"parameter_shard": {"device": 2 * 1000}, "gradients": {"file": 4 * 1000},
                          "master_weights": {"file": _F}, "optimizer_states": {"file": 2 * _F, "pinned_host": 12000}},
    # parameters in a file too: each unit's chunk (750 and 250 bf16) at an aligned offset, and 5
    # host buffers of the largest unit's chunk (750 elements)
    (3, "nvme", "nvme"): {"parameter_shard": {"file": 2 * 4096, "pinned_host": 5 * 750 * 2},
                          "gradients": {"file": 4 * 1000}, "master_weights": {"file": _F},
                          "optimizer_states": {"file": 2 * _F, "pinned_host": 12000}},
}


@pytest.mark.parametrize("key", sorted(_BY_HAND))
def test_offload_placement_by_hand(key: tuple[int, str, str]) -> None:
    stage, opt, par = key
    # Units above the persistence threshold are gathered, not kept: at stage 3 the module holds nothing.
    got = placement(TINY, stage, 4, "bf16", "fp32", Offload(opt, par), persistence_threshold=100)
    assert got.kinds == _BY_HAND[key]


def test_offload_placement_knobs_and_fp32() -> None:
    # Sub-groups of at most 500 elements: the units' chunks (750, 250) are one each; 2 slots of
    # the largest, and each file holds both regions at aligned offsets.
    got = placement(TINY, 3, 4, "bf16", "fp32", Offload("nvme", sub_group_size=500), persistence_threshold=100)
    assert got.kinds["optimizer_states"] == {"file": 2 * 2 * 4096, "pinned_host": 2 * 750 * 4 * 3}
    assert got.kinds["master_weights"] == {"file": 2 * 4096}
    unpinned = placement(TINY, 3, 4, "bf16", "fp32", Offload("nvme", pin_memory=False), persistence_threshold=100)
    assert unpinned.kinds["optimizer_states"] == {"file": 2 * _F, "host": 12000}
    assert unpinned.kinds["gradients"] == {"file": 4000}  # NVMe: the shard is a file-backed buffer
    # fp32 with an accelerator: the masters are a host copy of the parameters
    fp32 = placement(TINY, 2, 4, "fp32", "fp32", Offload("cpu"))
    assert fp32.kinds == {"parameters": {"device": 4 * 4000}, "gradients": {"pinned_host": 4000},
                          "master_weights": {"pinned_host": 4000}, "optimizer_states": {"host": 8000}}
    # without one, they are the parameters themselves (no master bytes, no master file)
    cpu_only = placement(TINY, 2, 4, "fp32", "fp32", Offload("nvme"), accelerator=False)
    assert cpu_only.kinds == {"parameters": {"host": 4 * 4000}, "gradients": {"file": 4000},
                              "optimizer_states": {"file": 2 * _F, "host": 1000 * 4 * 2}}
    # On 3 ranks each parameter is padded to a multiple of 3: S = 1000 + 334; stage 1's accumulator holds 3 rows
    padded = placement(TINY, 1, 3, "bf16", "fp32", Offload("cpu", pin_memory=False))
    assert padded.kinds["gradients"] == {"device": 4 * 3 * 1334}
    assert padded.kinds["master_weights"] == {"host": 4 * 1334}
    assert padded.kinds["optimizer_states"] == {"host": 8 * 1334}  # padding counted: the largest rank's bound
    # ZeRO-3 fp32 with masters and parameters both in host memory: one buffer, no parameter shard
    assert "parameter_shard" not in placement(TINY, 3, 4, "fp32", "fp32", Offload("cpu", "cpu")).kinds
    with pytest.raises(ValueError, match="stage 3"):
        placement(TINY, 2, 4, offload=Offload("cpu", "cpu"))
    with pytest.raises(ValueError, match="stage 1-3"):
        placement(TINY, 0, 4, offload=Offload("cpu"))


def test_offload_rows_per_node() -> None:
    hw = Hardware(gpus_per_node=4, nodes=1)
    row = zeroshard_row(TINY, hw, Training(), 3, offload=Offload("nvme", "nvme"))
    # units of 3000 and 1000 elements are below the persistence threshold: the GPU keeps them gathered
    assert row.offload == "optimizer+params->nvme" and row.model_states == 2 * 4000
    row = zeroshard_row(dataclasses.replace(TINY, units=(300_000, 100_001), param_numels=(300_000, 100_001),
                                            total_params=400_001), hw, Training(), 3, offload=Offload("nvme", "nvme"))
    assert row.model_states == 0  # both units gathered, the parameter shard in a file
    place = row.placement
    assert place is not None
    assert row.nvme_per_node == 4 * place.file
    # the larger of building the model (largest layer x 4 bytes x 4 processes x 1.5) and the offloaded state
    assert row.cpu_per_node == max(int(3000 * 4 * 4 * 1.5), 4 * place.host)
    assert row.cpu_per_node == 4 * place.host


def test_planner_chooses_nvme_when_host_memory_is_too_small(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    swap = tmp_path / "swap"
    swap.mkdir()
    args = ["--params", "7e9", "--gpus", "8", "--gpu-memory", "16GB", "--cpu-memory", "80GB"]
    code, text, err = _estimate_cli(*args, "--nvme-gb", "500", "--nvme-path", str(swap), "-o", str(out))
    assert code == 0, err
    # CPU offload needs 117 GiB of host memory per node here; with sub-groups of 1e9 elements the NVMe
    # swap buffers need 78 GiB (84 GB), so the planner takes 1e8 (31 GiB).
    assert "chosen: ZeRO stage 3, offload optimizer->nvme" in text and "NVMe per node" in text
    config = load_config(out, world_size=8)
    z = config.zero_optimization
    assert (z.offload_optimizer.device, z.offload_param.device) == ("nvme", "none")
    assert z.offload_optimizer.nvme_path == swap and z.sub_group_size == 100_000_000
    # The written config trains (world size 1, a small GPT; the swap files go under tmp_path).
    torch.manual_seed(0)
    engine, losses = _train_one_step(GPT(SMALL), json.loads(out.read_text()) | {"train_micro_batch_size_per_gpu": 2},
                                     steps=4)
    assert losses[-1] < losses[0] and engine.optimizer.memory_placement()["optimizer_states"]["file"] > 0
    engine.destroy()
    # An NVMe plan without --nvme-path: exit 1 naming the option; a disk too small: no NVMe plan.
    code, _, err = _estimate_cli(*args, "--nvme-gb", "500", "-o", str(tmp_path / "x.json"))
    assert code == 1 and "--nvme-path" in err and not (tmp_path / "x.json").exists()
    code, _, err = _estimate_cli(*args, "--nvme-gb", "10", "--nvme-path", str(swap), "-o", str(tmp_path / "x.json"))
    assert code == 1 and "no configuration fits" in err


@pytest.mark.parametrize("args, message", [
    (["--params", "7e9", "--nvme-gb", "100"], "--nvme-gb: only used with --gpu-memory"),
    (["--params", "7e9", "--gpu-memory", "16GB", "--nvme-path", "/x"], "give the disk budget per node with --nvme-gb"),
    (["--params", "7e9", "--gpu-memory", "16GB", "--nvme-gb", "0"], "--nvme-gb: must be a number of GB above 0"),
])
def test_nvme_option_errors(args: list[str], message: str) -> None:
    code, _, err = _estimate_cli(*args)
    assert code == 2 and message in err, err


def _nvme_engine(stage: int, dtype: str, params: str, swap: Path) -> Any:
    zero: dict[str, Any] = {"stage": stage, "sub_group_size": 20_000, "stage3_param_persistence_threshold": 4096,
                            "offload_optimizer": {"device": "nvme", "nvme_path": str(swap), "buffer_count": 2}}
    if params == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": str(swap), "buffer_count": 3}
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 1.0}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    torch.manual_seed(0)
    engine, _ = _train_one_step(GPT(NVME_GPT), config)  # after a step: the optimizer state exists
    # ZeRO-3 leaves the step's sub-groups, and the persistent units' gathers, to the next forward; the
    # estimate is of the state at rest with the persistent units gathered, as the forward leaves them
    engine.optimizer.store.settle()
    if stage == 3:
        engine.optimizer.coordinator.gather_persistent()
    return engine


# Small enough to set up in milliseconds; at stage 3 some units are gathered (above 4096 elements)
NVME_GPT = GPTConfig(vocab_size=512, block_size=32, n_layer=2, n_head=4, n_embd=64)
_NVME_CASES = [(1, "bf16", "none"), (2, "fp32", "none"), (3, "bf16", "none"), (3, "fp32", "nvme")]


def _nvme_prediction(stage: int, dtype: str, params: str) -> tuple[Any, Any]:
    with torch.device("meta"):
        spec = spec_from_module(GPT(NVME_GPT), "gpt")
    off = Offload("nvme", params, sub_group_size=20_000, buffer_count=2, param_buffer_count=3)
    return spec, placement(spec, stage, 1, dtype, "fp32", off, accelerator=False, persistence_threshold=4096)


def test_nvme_estimate_matches_the_engine(tmp_path: Path) -> None:
    for stage, dtype, params in _NVME_CASES:
        spec, want = _nvme_prediction(stage, dtype, params)
        engine = _nvme_engine(stage, dtype, params, tmp_path)
        case = (stage, dtype, params)
        try:
            got = {k: {p: n for p, n in v.items() if n} for k, v in engine.optimizer.memory_placement().items()
                   if any(v.values())}
            store = engine.optimizer.store
            # Adam's step counters (a 0-d fp32 tensor per parameter) stay in host memory; the estimate leaves them out.
            steps = 4 * len(spec.param_numels or ())
            buffers = want.kinds["optimizer_states"].pop("host")
            assert sum(slot.nbytes for slot in store.slots) == buffers, case
            # what sub_group_size promises: buffer_count buffers of a sub-group (or of the largest
            # parameter, ZeRO-3: unit, when larger), masters and Adam's two moments, 4096-aligned each
            largest = max(20_000, *(spec.units if stage == 3 else spec.param_numels))  # type: ignore[arg-type]
            assert buffers <= 2 * (3 * largest * 4 + 3 * 4096), (case, buffers, largest)
            assert got["optimizer_states"].pop("host") == steps + buffers, case
            assert got.pop("optimizer_states") == want.kinds.pop("optimizer_states"), case
            assert engine.memory_usage()["parameters"] == want.kinds.pop("parameters")["host"], case
            if params == "nvme":  # the pool allocates its buffers as units are read: at most the estimate
                pool, bound = got["parameter_shard"].pop("host"), want.kinds["parameter_shard"].pop("host")
                assert 0 < pool <= bound and bound == 3 * max(spec.units or ()) * 4, case
            assert got == want.kinds, case
        finally:
            engine.destroy()


def test_nvme_memory_placement_counts_swap_buffers(tmp_path: Path) -> None:
    spec, want = _nvme_prediction(2, "bf16", "none")
    engine = _nvme_engine(2, "bf16", "none", tmp_path)
    try:
        steps = 4 * len(spec.param_numels or ())
        assert engine.optimizer.memory_placement()["optimizer_states"]["host"] == \
            want.kinds["optimizer_states"]["host"] + steps
    finally:
        engine.destroy()


def test_estimate_keeps_a_different_config_already_at_the_output_path(tmp_path: Path) -> None:
    """The default -o is ds_config.json, the name of the user's own config: a different file there
    is kept (exit 2 naming it) unless --force; the same config again is fine."""
    out = tmp_path / "ds_config.json"
    mine = '{"train_batch_size": 32, "zero_optimization": {"stage": 3}}\n'
    out.write_text(mine)
    args = ["--params", "1e9", "--gpus", "8", "--gpu-memory", "80GB", "-o", str(out)]
    code, text, err = _estimate_cli(*args)
    assert code == 2 and str(out) in err and "--force" in err and "chosen: ZeRO stage" in text
    assert out.read_text() == mine
    code, text, err = _estimate_cli(*args, "--force")
    assert code == 0 and f"wrote {out}" in text and out.read_text() != mine
    written = out.read_text()
    code, _, err = _estimate_cli(*args)  # what it would write anyway
    assert code == 0 and out.read_text() == written, err


def test_estimate_prints_the_config_unless_told_where_to_write_it(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Without -o nothing is written (the working directory is often the user's project, holding
    their own ds_config.json): the chosen config is printed, as JSON that loads."""
    monkeypatch.chdir(tmp_path)
    code, text, err = _estimate_cli("--params", "1e9", "--gpus", "8", "--gpu-memory", "80GB")
    assert code == 0, err
    assert not list(tmp_path.iterdir()) and "wrote" not in text
    printed = text[text.index("\n{", text.index("chosen: ZeRO stage")) + 1:]
    config = load_config(json.loads(printed), world_size=8)
    assert f"chosen: ZeRO stage {config.zero_stage}" in text


def test_hpz_secondary_shards_in_the_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    """Stage 3 with hpZ holds 1/h of every released unit on top of the rest; other stages nothing;
    a stage-3 row's buffers grow by it and its config carries the key; the CLI takes --hpz, a
    divisor of --gpus. (That the engine holds exactly this: tests/distributed/test_zeropp.py.)"""
    from zeroshard.cli.estimate import main
    from zeroshard.estimate.model_spec import spec_from_count
    from zeroshard.estimate.planner import Hardware, Training, ds_config, zeroshard_row
    from zeroshard.estimate.states import model_states

    spec = spec_from_count(1_000_000_000, 50_000_000)
    plain, hpz = (model_states(spec, 3, 16, "bf16", hpz_partition_size=h) for h in (1, 8))
    assert plain.secondary == 0 and hpz.buffers - plain.buffers == hpz.secondary
    assert abs(hpz.secondary - 2 * 1_000_000_000 / 8) < 2 * 16 * 20  # bf16, 1/8, padding aside
    assert model_states(spec, 2, 16, "bf16", hpz_partition_size=8).secondary == 0
    hw = Hardware(8, 2, None, None)
    rows = [zeroshard_row(spec, hw, Training(hpz_partition_size=h), 3) for h in (1, 8)]
    assert rows[1].buffers - rows[0].buffers == hpz.secondary
    assert ds_config(rows[1], Training(hpz_partition_size=8))["zero_optimization"]["zero_hpz_partition_size"] == 8
    assert "zero_hpz_partition_size" not in ds_config(rows[0], Training())["zero_optimization"]
    with pytest.raises(SystemExit):
        main(["--params", "1e9", "--gpus", "8", "--hpz", "3"])
    assert "must divide the 8 GPUs of a node" in capsys.readouterr().err
    assert main(["--params", "1e9", "--gpus", "8", "--hpz", "8"]) == 0
