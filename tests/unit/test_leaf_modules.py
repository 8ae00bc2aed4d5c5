"""ZeRO-3 leaf modules: DeepSpeed's helpers and its ``zero_optimization.leaf_module`` block (one process)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.config import load_config
from zeroshard.deepspeed.utils import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module
from zeroshard.errors import ConfigError


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)


def test_helpers_match_classes_by_type_and_by_name_plain_or_qualified() -> None:
    model = nn.Sequential(Block(), nn.Linear(3, 3), Block())
    assert set_z3_leaf_modules(model, [Block]) == [model[0], model[2]]
    assert get_z3_leaf_modules(model) == [model[0], model[2]] and not z3_leaf_module(model[1])
    assert unset_z3_leaf_modules(model, ["Block"]) == [model[0], model[2]] and get_z3_leaf_modules(model) == []
    assert set_z3_leaf_modules(model, [f"{__name__}.Block"]) == [model[0], model[2]]
    with pytest.raises(ValueError, match="no module of the classes"):
        set_z3_leaf_modules(model, ["MixtralSparseMoeBlock"])
    assert set_z3_leaf_modules(model, ["MixtralSparseMoeBlock"], raise_if_not_found=False) == []


def test_leaf_module_block_reads_one_string_as_a_list_and_names_a_bad_value() -> None:
    cfg = load_config({"train_batch_size": 1, "zero_optimization": {"stage": 3, "leaf_module": {
        "names": "block.moe"}}}, world_size=1)
    assert cfg.zero_optimization.leaf_module.names == ["block.moe"]
    assert any("MixtralSparseMoeBlock" in c for c in cfg.zero_optimization.leaf_module.classes)  # DeepSpeed's default
    with pytest.raises(ConfigError, match="zero_optimization.leaf_module.classes"):
        load_config({"train_batch_size": 1, "zero_optimization": {"stage": 3, "leaf_module": {"classes": 3}}},
                    world_size=1)


def test_hugging_face_mixtral_blocks_are_leaves_by_default_at_zero3(process_group: None) -> None:
    """DeepSpeed's default classes: each layer's sparse MoE block is gathered whole."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    engine, *_ = zeroshard.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    leaves = [type(m).__name__ for m in get_z3_leaf_modules(engine.module)]
    assert leaves == ["MixtralSparseMoeBlock"] * 2
    ids = torch.randint(0, 64, (1, 8))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.destroy()


def test_deepspeeds_module_path_of_the_helpers_resolves_to_zeroshards() -> None:
    """``from deepspeed.utils.z3_leaf_module import set_z3_leaf_modules`` under the compatibility layer."""
    code = ("import zeroshard.deepspeed.imports as c; c.enable(shadow=True)\n"
            "from deepspeed.utils.z3_leaf_module import set_z3_leaf_modules, z3_leaf_module\n"
            "import torch, zeroshard.core.zero3.units as u\n"
            "m = torch.nn.Sequential(torch.nn.Linear(2, 2))\n"
            "assert set_z3_leaf_modules is u.set_z3_leaf_modules and set_z3_leaf_modules(m, ['Linear']) == [m[0]]\n"
            "assert z3_leaf_module(m[0])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.sub, self.act = nn.Linear(100, 100), Block(), nn.GELU()


@pytest.mark.parametrize("threshold, expected", [
    (0, []),  # the default: nothing
    (7, []),  # below every granularity (a warning names the smallest, 8)
    (8, ["0.sub", "1"]),  # Block: 24 elements over 3 layers (itself and two Linears)
    (2024, ["0", "1"]),  # Wide: 10124 elements over 5 layers, marked before its Block
])
def test_granularity_threshold_marks_as_deepspeed(threshold: int, expected: list[str],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """``stage3_module_granularity_threshold``: parents first; containers (the Sequential), modules
    without children (the Linears) and modules without parameters (GELU) are never marked."""
    from zeroshard.core.zero3.units import mark_fine_grained_leaves

    model = nn.Sequential(Wide(), Block(), nn.Linear(3, 3))
    names = {id(m): n for n, m in model.named_modules()}
    marked = mark_fine_grained_leaves(model, threshold)
    assert [names[id(m)] for m in marked] == expected
    assert [names[id(m)] for m in get_z3_leaf_modules(model)] == sorted(expected)
    assert ("smallest granularity is 8" in caplog.text) == (threshold == 7)
