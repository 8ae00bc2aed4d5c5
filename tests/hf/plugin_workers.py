"""accelerate's own ``DeepSpeedPlugin`` as its users build it, driving zeroshard (through
``zeroshard.deepspeed.imports``), and the plain-PyTorch reference for the same global batches.

The plugin writes what it is given whatever the stage: ``offload_param_device="cpu"`` at stage 2 puts an
``offload_param`` block into a stage-2 config, which DeepSpeed 0.19.8 accepts and ignores.
"""

from __future__ import annotations

from typing import Any

import torch

MICRO, ACCUM, STEPS, LR = 2, 2, 3, 1e-2
CLIP = 1.0  # accelerate resolves the plugin's gradient_clipping "auto" to 1.0


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.Tanh(), torch.nn.Linear(31, 5))


def global_batches(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[STEPS, ACCUM, world * MICRO, ...]: step s, micro-step a, rank r takes rows r*MICRO:(r+1)*MICRO."""
    g = torch.Generator().manual_seed(1)
    n = world * MICRO
    return torch.randn(STEPS, ACCUM, n, 13, generator=g), torch.randn(STEPS, ACCUM, n, 5, generator=g)


def reference(world: int) -> dict[str, torch.Tensor]:
    """One process, plain AdamW, clipped as accelerate's config says: each step's gradient is the mean
    loss's over its ACCUM micro-batches."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = global_batches(world)
    for s in range(STEPS):
        for a in range(ACCUM):
            (torch.nn.functional.mse_loss(model(x[s, a]), y[s, a]) / ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def plugin_worker(rank: int, world: int) -> dict[str, Any]:
    """accelerate's loop (``accumulate``, ``backward``, ``step``) with the plugin of its gradient-accumulation
    tests, offload of optimizer and parameters to the CPU, at ZeRO stage 2."""
    import os

    import zeroshard.deepspeed.imports as layer

    layer.enable(shadow=True)
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DeepSpeedPlugin

    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    plugin = DeepSpeedPlugin(zero_stage=2, offload_param_device="cpu", offload_optimizer_device="cpu",
                             gradient_accumulation_steps=ACCUM)
    zero = plugin.deepspeed_config["zero_optimization"]
    written = {k: dict(v) if isinstance(v, dict) else v for k, v in zero.items()}
    accelerator = Accelerator(deepspeed_plugin=plugin)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = global_batches(world)
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    data = [(x[s, a, rows], y[s, a, rows]) for s in range(STEPS) for a in range(ACCUM)]
    # accelerate reads the micro-batch size from the loader; the loop below takes the rows it is given
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.flatten(0, 2)), batch_size=MICRO)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    engine = accelerator.deepspeed_engine_wrapped.engine
    for xb, yb in data:  # accelerate's sharding of the loader is not what is tested: the rows are fixed
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    from zeroshard.deepspeed.utils import safe_get_full_fp32_param

    params = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    return {"written": written, "params": params, "steps": engine.global_steps,
            "clip": engine.gradient_clipping(), "gas": engine.gradient_accumulation_steps(),
            "offload_param": engine.config.zero_optimization.offload_param.device,
            "offload_optimizer": engine.config.zero_optimization.offload_optimizer.device}
