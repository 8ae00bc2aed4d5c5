"""Train a small character-level GPT on Shakespeare's sonnets, the DeepSpeed way.

This is an unmodified DeepSpeed training loop (``deepspeed.initialize``, then ``engine(x, y)``,
``engine.backward(loss)``, ``engine.step()`` for every micro batch) that runs on zeroshard by
importing it under DeepSpeed's name. ``--peer deepspeed`` runs the very same loop on the real
DeepSpeed, for comparison.

    zeroshard launch --nproc_per_node 2 examples/train_gpt.py --config examples/configs/stage2.json
    torchrun --nproc_per_node 2 examples/train_gpt.py --peer deepspeed --config examples/configs/stage1.json

Rank 0 shows progress once: on a terminal, a progress bar (tqdm, on stderr) whose tail carries the
loss (averaged over the gradient accumulation window and over all ranks) and the global throughput,
updated every ``--log_interval`` steps; elsewhere (a log file, CI), or with ``--no_progress``, a line
with the same figures every ``--log_interval`` steps. Then a summary. The script exits with status 1
when the last loss is not below the first, so it doubles as a smoke test.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig
from tqdm import tqdm

HERE = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peer", choices=["zeroshard", "deepspeed"], default="zeroshard",
                   help="library to train with: zeroshard (default) or the real deepspeed")
    p.add_argument("--config", default=str(HERE / "configs" / "stage1.json"), help="DeepSpeed JSON config")
    p.add_argument("--data", default=str(HERE / "data" / "sonnets.txt"), help="plain-text training corpus")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--block_size", type=int, default=64, help="context length in characters")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--tie_weights", action="store_true", help="share the token embedding with the LM head")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log_interval", type=int, default=10, help="print every N steps")
    p.add_argument("--no_progress", action="store_true", help="lines, not a progress bar, on a terminal too")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1,
                   help="ignored: set by some launchers; the rank is read from the environment")
    args = p.parse_args()
    if args.steps < 1:
        p.error(f"argument --steps: must be at least 1, got {args.steps}")
    return args


def single_process_defaults() -> None:
    """Let ``python examples/train_gpt.py`` run as a world of one, without any launcher."""
    if "RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def main() -> int:
    args = parse_args()
    if args.peer == "deepspeed":
        import deepspeed
    else:
        import zeroshard as deepspeed

    single_process_defaults()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    # Character-level tokens: the vocabulary is the set of characters of the corpus.
    text = Path(args.data).read_text(encoding="utf-8")
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    config = GPTConfig(vocab_size=len(chars), block_size=args.block_size, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout,
                       tie_weights=args.tie_weights)
    model = GPT(config)
    n_params = model.num_parameters()

    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=args.config
    )
    micro_batch = engine.train_micro_batch_size_per_gpu()
    accumulation = engine.gradient_accumulation_steps()
    device = engine.device
    tokens_per_step = micro_batch * accumulation * args.block_size * world  # global

    # Each rank draws its own micro batches, from its own seeded generator.
    generator = torch.Generator().manual_seed(args.seed + 1 + rank)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(data) - args.block_size - 1, (micro_batch,), generator=generator)
        x = torch.stack([data[i : i + args.block_size] for i in starts.tolist()])
        y = torch.stack([data[i + 1 : i + 1 + args.block_size] for i in starts.tolist()])
        return x.to(device), y.to(device)

    if rank == 0:
        print(f"[{args.peer}] world={world} device={device} params={n_params / 1e6:.2f}M "
              f"vocab={len(chars)} corpus={len(text)} chars micro_batch={micro_batch} "
              f"grad_accum={accumulation} tokens/step={tokens_per_step} config={args.config}", flush=True)

    first_loss = last_loss = float("nan")
    # one form of progress: a bar where someone watches it, lines where it is logged (a bar's carriage
    # returns make a log file unreadable, and a line printed through a bar repeats what the bar says)
    show_bar = rank == 0 and not args.no_progress and sys.stderr.isatty()
    bar = tqdm(total=args.steps, desc="training", unit="step", file=sys.stderr, dynamic_ncols=True,
               disable=not show_bar)
    start = time.perf_counter()
    last_log_step, last_log_time = 1, start
    after_first = start
    for step in range(1, args.steps + 1):
        window_loss = torch.zeros((), device=device)
        for _ in range(accumulation):
            x, y = get_batch()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            window_loss += loss.detach().float()
        bar.update(1)

        if step == 1 or step == args.steps or step % args.log_interval == 0:
            dist.all_reduce(window_loss)  # every rank logs the same steps, so this collective matches
            step_loss = window_loss.item() / (accumulation * world)
            first_loss = step_loss if step == 1 else first_loss
            last_loss = step_loss
            now = time.perf_counter()
            if rank == 0:
                line = f"step {step:5d} | loss {step_loss:.4f} | lr {engine.get_lr()[0]:.2e}"
                postfix = {"loss": f"{step_loss:.4f}"}
                if step > 1:  # step 1 includes the warm-up: throughput is measured from its end
                    rate = tokens_per_step * (step - last_log_step) / (now - last_log_time)
                    line += f" | {rate:,.0f} tokens/s"
                    postfix["tokens/s"] = f"{rate:,.0f}"
                if show_bar:
                    bar.set_postfix(postfix)
                else:
                    print(f"{line} | {step}/{args.steps}", flush=True)
            last_log_step, last_log_time = step, now
            if step == 1:
                after_first = now

    bar.close()
    wall = time.perf_counter() - start
    rate = tokens_per_step * (args.steps - 1) / (last_log_time - after_first) if args.steps > 1 else 0.0
    improved = last_loss < first_loss
    if rank == 0:
        print(f"[{args.peer}] done: {args.steps} steps in {wall:.1f}s | first loss {first_loss:.4f} "
              f"| last loss {last_loss:.4f} | {rate:,.0f} tokens/s after step 1 "
              f"| {'OK' if improved else 'FAILED: the loss did not go down'}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if improved else 1


if __name__ == "__main__":
    sys.exit(main())
