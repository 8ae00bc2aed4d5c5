"""accelerate's ZeRO-3 save recipe, run on every rank as its documentation writes it::

    unwrapped.save_pretrained(dir, is_main_process=..., save_function=accelerator.save,
                              state_dict=accelerator.get_state_dict(model))

``get_state_dict`` is the engine's consolidated 16-bit state dict: rank 0 gets the weights, the other
ranks ``None``, so transformers calls ``model.state_dict()`` on those ranks alone. That was a
collective here (a gather waiting for rank 0, which never came: a ``DistributedError`` after the
arrival timeout); now it returns DeepSpeed's empty placeholders there, until the next forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'zeroshard[hf]')")

from harness import log_lines, run_distributed  # noqa: E402

WORLD = 2


def save_recipe_worker(rank: int, world: int, out: str) -> dict[str, Any]:
    import logging

    from transformers import LlamaConfig, LlamaForCausalLM

    import zeroshard

    said = log_lines(logging.INFO)
    logging.getLogger("zeroshard").setLevel(logging.INFO)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(config)
    engine, *_ = zeroshard.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_gather_16bit_weights_on_model_save": True}})
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    with zeroshard.zero.GatheredParameters(list(model.parameters())):
        want = {n: p.detach().clone() for n, p in model.named_parameters()}
    state_dict = engine._zero3_consolidated_16bit_state_dict()  # accelerator.get_state_dict(model)
    model.save_pretrained(out, is_main_process=rank == 0, state_dict=state_dict)
    # A forward ends the placeholder window: a state dict taken on every rank is whole again.
    engine.eval()
    with torch.no_grad():
        engine(input_ids=ids)
    whole = {k: v.clone() for k, v in model.state_dict().items()}
    engine.destroy()
    return {"want": want, "got_none": state_dict is None, "whole": whole,
            "said": [w for w in said if "placeholders" in w]}


def test_accelerate_zero3_save_recipe_on_every_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors.torch import load_file

    monkeypatch.setenv("ZEROSHARD_ARRIVAL_TIMEOUT", "20")  # the old code failed here after this long
    results = run_distributed(save_recipe_worker, WORLD, str(tmp_path / "saved"), timeout=300)
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    want = results[0]["want"]
    for name, tensor in saved.items():
        torch.testing.assert_close(tensor, want[name], rtol=0, atol=0)
    assert set(want) - set(saved) <= {"lm_head.weight"}  # tied to the embedding
    assert results[0]["got_none"] is False and results[1]["got_none"] is True
    assert not results[0]["said"] and len(results[1]["said"]) == 1, results[1]["said"]
    for r in results:
        for name, tensor in want.items():
            torch.testing.assert_close(r["whole"][name], tensor, rtol=0, atol=0)
