"""An ordinary accelerate training script, launched by ``test_hf_accelerate_launch.py`` with
``python -m zeroshard.deepspeed.accelerate_launch --use_deepspeed ...``: nothing here mentions zeroshard.

The DeepSpeed settings (stage, accumulation, clipping) come from the launcher's flags through the
environment, as with ``accelerate launch``. Each rank writes what it saw to ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import deepspeed
import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, SEQ, MICRO, STEPS = 128, 16, 2, 4


def main() -> None:
    out = Path(sys.argv[1])
    # Without CUDA accelerate picks no process-group backend for DeepSpeed: name gloo.
    handlers = [] if torch.cuda.is_available() else [InitProcessGroupKwargs(backend="gloo")]
    accelerator = Accelerator(kwargs_handlers=handlers)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gas = accelerator.gradient_accumulation_steps
    # learnable rows: each counts up by one from a random start
    rows = (torch.randint(0, VOCAB, (accelerator.num_processes * MICRO * gas * STEPS, 1),
                          generator=torch.Generator().manual_seed(1)) + torch.arange(SEQ)) % VOCAB
    loader = torch.utils.data.DataLoader(rows, batch_size=MICRO)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for ids in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(loss.detach()))
    record = {"deepspeed": deepspeed.__version__, "engine": f"{type(model).__module__}.{type(model).__name__}",
              "distributed_type": str(accelerator.distributed_type), "world": accelerator.num_processes,
              "stage": model.zero_optimization_stage(), "gas": model.gradient_accumulation_steps(),
              "clip": model.gradient_clipping(), "optimizer_steps": model.global_steps, "losses": losses}
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
