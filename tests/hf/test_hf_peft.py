"""LoRA fine-tuning with PEFT (issue 13's Hugging Face contract, the pattern most fine-tuning uses):
``get_peft_model`` on a transformers model, then ``initialize`` with the adapters as the trainable
parameters, at stage 2 and at stage 3 with the base model loaded by ZeRO-3 ``from_pretrained``
(partitioned by ``zero.Init``; that crashed in forward before, on the frozen weights' placeholders).
Reference: plain PyTorch on one process over the same global batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'zeroshard[hf]')")
pytest.importorskip("peft", reason="peft is not installed (pip install 'zeroshard[test]')")

import hf_workers as W  # noqa: E402  (after the skips: nothing to import without transformers)
from harness import run_distributed  # noqa: E402
from models import relative_distance  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

WORLD = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("peft")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=W.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(root / "init")
    return {"ranks": run_distributed(W.peft_worker, WORLD, str(root), timeout=600),
            "ref": W.peft_reference(str(root), WORLD), "init": _initial(root)}


def _initial(root: Path) -> dict[str, torch.Tensor]:
    model = W.lora(AutoModelForCausalLM.from_pretrained(root / "init"))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_trains_as_plain_pytorch(runs: dict[str, Any], stage: int) -> None:
    ref, init = runs["ref"], runs["init"]
    adapters = [n for n in ref if "lora_" in n]
    assert adapters and all(not torch.equal(ref[n], init[n]) for n in adapters), "the reference did not train"
    for rank, result in enumerate(runs["ranks"]):
        got = result[stage]
        assert set(got) == set(ref)
        for n in ref:
            if n not in adapters:
                assert torch.equal(got[n], init[n]), f"rank {rank}, stage {stage}: frozen {n} changed"
        rel = relative_distance(got, ref, adapters)
        assert rel <= 1e-5, f"rank {rank}, stage {stage}: ‖w − w_ref‖/‖w_ref‖ = {rel:.2e}"


def test_stage3_base_arrived_partitioned(runs: dict[str, Any]) -> None:
    """The stage-3 run is the one users hit: its base weights came from zero.Init, not whole."""
    assert all(r["partitioned_3"] for r in runs["ranks"])
    assert not any(r["partitioned_2"] for r in runs["ranks"])


def test_stage3_keeps_a_chunk_of_the_frozen_base(runs: dict[str, Any]) -> None:
    """Stage 3 partitions the frozen base (about half of it per rank on 2 ranks, a little more for
    the padding of odd sizes); stage 2 keeps it whole, outside any shard."""
    for r in runs["ranks"]:
        assert 0.5 * r["frozen_bytes"] <= r["frozen_shard_3"] <= 0.51 * r["frozen_bytes"], r
        assert r["frozen_shard_2"] == 0
