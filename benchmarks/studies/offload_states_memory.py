"""Device memory handed back by ``engine.offload_states()`` and taken again by ``reload_states()``, per state.

    python benchmarks/studies/offload_states_memory.py [--layers 8] [--dim 2048] [--stages 1,2,3]

One rank, bf16, AdamW, a stack of ``--layers`` linear layers of ``--dim`` x ``--dim`` (134M parameters at
the defaults). For each ZeRO stage the engine takes one optimizer step, then runs one more forward and
backward (so the gradient accumulator or shard exists, as between backward and step), and for each of
DeepSpeed's state names, then for all of them (``include=None``), measures
``torch.cuda.memory_allocated()`` before ``offload_states(include=[name])``, after it and after
``reload_states()``, beside the bytes the engine says it moved (``engine.optimizer.state_mover.moved_bytes``).
The drop should equal the bytes moved (each buffer rounded up to the allocator's 512-byte blocks), and
the reload should bring the same amount back. The last step checks that training continues. Prints a
Markdown table; without a GPU there is no device allocator to read, only the bytes moved.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import zeroshard

NAMES = ["optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer", None]
MiB = 2**20


def _allocated(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return int(torch.cuda.memory_allocated(device))


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / MiB:.1f}"


def run_stage(stage: int, args: argparse.Namespace) -> list[str]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.dim, args.dim) for _ in range(args.layers)])
    cfg = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    device = engine.device
    x = torch.randn(4, args.dim, device=device)

    def backward() -> None:
        engine.backward(engine(x).float().pow(2).mean())

    backward()
    engine.step()
    backward()  # the gradients of this window exist until the step below
    rows = []
    for name in NAMES:
        before = _allocated(device)
        engine.offload_states(include=None if name is None else [name])
        after = _allocated(device)
        moved = engine.optimizer.state_mover.moved_bytes
        engine.reload_states()
        back = _allocated(device)
        drop = None if before is None or after is None else before - after
        regained = None if back is None or after is None else back - after
        rows.append(f"| {stage} | {name or 'all (include=None)'} | {_mib(moved)} | {_mib(before)} | {_mib(after)} "
                    f"| {_mib(drop)} | {_mib(regained)} |")
    engine.step()
    engine.destroy()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--stages", default="1,2,3")
    args = parser.parse_args()
    zeroshard.init_distributed()
    params = args.layers * (args.dim * args.dim + args.dim)
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "the CPU (no device allocator to read)"
    print(f"{params / 1e6:.0f}M parameters, bf16, AdamW, 1 rank on {where}\n")
    print("| stage | include | moved (MiB) | allocated before | after offload | dropped | regained on reload |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for stage in (int(s) for s in args.stages.split(",")):
        for row in run_stage(stage, args):
            print(row, flush=True)


if __name__ == "__main__":
    main()
