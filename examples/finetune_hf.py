"""Train a small Hugging Face causal LM on Shakespeare's sonnets with the Trainer, on zeroshard.

The Trainer drives DeepSpeed through transformers' and accelerate's own code; with
``zeroshard.deepspeed.imports`` enabled (first lines below) that DeepSpeed is zeroshard. The model is
a byte-level Llama built from a config (nothing is downloaded) and the DeepSpeed config is the
usual one full of ``"auto"`` values, which the Trainer fills in from its ``TrainingArguments``.

    zeroshard launch --nproc_per_node 2 examples/finetune_hf.py --stage 3
    zeroshard launch --nproc_per_node 2 examples/finetune_hf.py --stage 2 --steps 60 --output_dir /tmp/sonnets-lm
    python -m zeroshard.deepspeed.accelerate_launch --use_deepspeed --num_processes 2 examples/finetune_hf.py --stage 3

At the end it evaluates on held-out lines, saves the model (``from_pretrained`` loads it) and exits
with status 1 when the last training loss is not below the first, so it doubles as a smoke test.
"""

from __future__ import annotations

import zeroshard.deepspeed.imports

# Before transformers or accelerate are imported: they check for DeepSpeed once, at import. This
# script asks for zeroshard explicitly, so it also hides a real DeepSpeed installed alongside.
zeroshard.deepspeed.imports.enable(shadow=True)

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

HERE = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=2, help="ZeRO stage")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--data", default=str(HERE / "data" / "sonnets.txt"), help="plain-text training corpus")
    p.add_argument("--block_size", type=int, default=64, help="context length in bytes")
    p.add_argument("--micro_batch", type=int, default=8, help="sequences per rank per micro-step")
    p.add_argument("--grad_accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--output_dir", default="finetune_hf_out", help="checkpoints and the final model")
    return p.parse_args()


def ds_config(stage: int) -> dict[str, Any]:
    """The DeepSpeed config of Hugging Face's documentation: every size and hyperparameter "auto"."""
    return {
        "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                           "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "zero_optimization": {"stage": stage, "overlap_comm": True, "reduce_bucket_size": "auto",
                              "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                              "stage3_gather_16bit_weights_on_model_save": True},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    }


def blocks(path: str, size: int) -> list[dict[str, torch.Tensor]]:
    """Non-overlapping blocks of the file's bytes; labels are the inputs (the model shifts them)."""
    data = torch.tensor(list(Path(path).read_bytes()), dtype=torch.long)
    rows = data[: len(data) // size * size].view(-1, size)
    return [{"input_ids": r, "labels": r} for r in rows]


def cpu_distributed_state() -> bool:
    """Without CUDA, accelerate picks no process-group backend for DeepSpeed (and would count one
    process): create its state with gloo here, for the Trainer to reuse. Returns whether it did."""
    if torch.cuda.is_available():
        return False
    from accelerate.state import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    return True


def main() -> int:
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:  # plain `python finetune_hf.py`: a one-process job
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    configured = cpu_distributed_state()
    data = blocks(args.data, args.block_size)
    held_out = max(1, len(data) // 20)
    training = TrainingArguments(
        output_dir=args.output_dir, deepspeed=ds_config(args.stage), max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch, per_device_eval_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, weight_decay=0.01, warmup_steps=5,
        logging_steps=max(1, args.steps // 10), save_steps=args.steps, report_to=[], seed=0,
        accelerator_config={"use_configured_state": configured}, disable_tqdm=True)
    # Built after TrainingArguments: at stage 3, from_pretrained / from_config would partition it
    # under zero.Init; a model built directly is partitioned by the engine.
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=args.block_size))
    trainer = Trainer(model=model, args=training, train_dataset=data[held_out:], eval_dataset=data[:held_out])
    trainer.train()
    evaluation = trainer.evaluate()
    trainer.save_model(args.output_dir)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if trainer.is_world_process_zero():
        print(f"ZeRO stage {args.stage}: training loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
              f"held-out loss {evaluation['eval_loss']:.4f}; model saved to {args.output_dir}", flush=True)
    return 0 if losses[-1] < losses[0] else 1


if __name__ == "__main__":
    sys.exit(main())
