"""Offload on one GPU: a GPT trained a few steps with and without offload; tokens/s, peak device
memory and peak host memory (each configuration in its own process, so the peaks are its own).

    python benchmarks/studies/gpu_offload.py --layers 32 --d-model 2560 --configs none,cpu,cpu+params
    python benchmarks/studies/gpu_offload.py --layers 24 --d-model 2048 --configs nvme+params --nvme /tmp/nvme

Random initialisation, byte-level vocabulary, bf16, ZeRO-3, one rank over NCCL.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OFFLOAD = {
    "none": ("none", "none"), "cpu": ("cpu", "none"), "cpu+params": ("cpu", "cpu"),
    "nvme": ("nvme", "none"), "nvme+params": ("nvme", "nvme"),
}


def _child(args: argparse.Namespace) -> None:
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, GPTConfig

    import zeroshard

    opt, param = OFFLOAD[args.child]
    z: dict = {"stage": 3, "sub_group_size": int(args.sub_group), "stage3_max_live_parameters": int(3e8),
               "stage3_prefetch_bucket_size": int(1e8)}
    if opt != "none":
        z["offload_optimizer"] = {"device": opt, "nvme_path": args.nvme, "pin_memory": True}
    if param != "none":
        z["offload_param"] = {"device": param, "nvme_path": args.nvme, "pin_memory": True, "buffer_size": int(4e8)}
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "gradient_clipping": 1.0, "zero_optimization": z,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}}}
    zeroshard.init_distributed()
    torch.manual_seed(0)
    gcfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.d_model // 128,
                     n_embd=args.d_model, dropout=0.0, bias=True)
    started = time.perf_counter()
    cuda = torch.cuda.is_available()  # on a CPU-only machine the script still runs (to check it)
    dev = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with dev:
        model = GPT(gcfg)
    numel = sum(p.numel() for p in model.parameters())
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    del model
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    setup = time.perf_counter() - started
    x = torch.randint(0, 256, (args.batch, args.seq), device=dev)
    times, losses, phases = [], [], []
    for _ in range(args.steps):
        sync()
        t = time.perf_counter()
        loss = engine(x, x)
        sync()
        t1 = time.perf_counter()
        engine.backward(loss)
        sync()
        t2 = time.perf_counter()
        if args.profile and len(times) == args.steps - 1:  # where the last step's time goes, by operator
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                engine.step()
                sync()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), file=sys.stderr)
        else:
            engine.step()
        sync()
        times.append(time.perf_counter() - t)
        phases.append((t1 - t, t2 - t1, time.perf_counter() - t2))
        losses.append(float(loss))
    step = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    out = {"config": args.child, "params": numel, "setup_s": round(setup, 1), "step_s": round(step, 3),
           "tokens_per_s": round(args.batch * args.seq / step), "losses": [round(v, 3) for v in losses],
           "forward_backward_step_s": [round(v, 3) for v in phases[-1]],
           "peak_device_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
           "peak_host_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
           "placement_gib": {k: {p: round(b / 2**30, 2) for p, b in v.items()}
                             for k, v in engine.optimizer.memory_placement().items()}}
    engine.destroy()
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--d-model", type=int, default=2560)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sub-group", type=float, default=1e8)
    ap.add_argument("--configs", default="none,cpu,cpu+params")
    ap.add_argument("--nvme", default="/tmp/zeroshard-nvme")
    ap.add_argument("--timeout", type=float, default=200)
    ap.add_argument("--profile", action="store_true", help="print the last step's top CPU operators")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    os.makedirs(args.nvme, exist_ok=True)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611", "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    print("| config | params | step s | tokens/s | peak device GiB | peak host RSS GiB | setup s | losses |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.configs.split(","):
        cmd = [sys.executable, __file__, "--child", name, "--layers", str(args.layers), "--d-model",
               str(args.d_model), "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps),
               "--sub-group", str(args.sub_group), "--nvme", args.nvme] + (["--profile"] if args.profile else [])
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"| {name} | timed out after {args.timeout:.0f} s |")
            continue
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"| {name} | failed: {proc.stderr.strip().splitlines()[-1:] } |")
            continue
        r = json.loads(line[7:])
        if args.profile:
            print("\n".join(ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("[")), flush=True)
        print(f"| {name} | {r['params'] / 1e9:.2f}B | {r['step_s']} | {r['tokens_per_s']} | {r['peak_device_gib']} | "
              f"{r['peak_host_rss_gib']} | {r['setup_s']} | {r['losses']} |", flush=True)
        print(f"<!-- {name}: last step forward/backward/step s {r['forward_backward_step_s']}; placement GiB "
              f"{json.dumps(r['placement_gib'])} -->", flush=True)


if __name__ == "__main__":
    main()
