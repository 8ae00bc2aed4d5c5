"""What RLHF and preference-tuning code (TRL's GRPO/PPO/DPO, OpenRLHF) does with ZeRO-3 engines, on 2 ranks.

- TRL's generation recipe: inside ``GatheredParameters(model.parameters())`` it removes the ZeRO-3
  hooks (``optimizer.parameter_offload``: ``ds_active_sub_modules``, ``ds_external_parameters()``,
  ``forward_hooks``, ``backward_hooks``), generates (here: a different number of forwards per rank,
  as generations of different lengths are), and registers them again
  (``_register_deepspeed_module``). zeroshard had none of these names (``AttributeError`` at the first
  rollout); now training after it equals plain PyTorch.
- A reference model: an engine without optimizer, forwards under ``no_grad``. Its units stayed
  gathered after each forward (the live budget holds them from pass to pass, and no backward ever
  ended the pass), so the whole model sat on every rank; now each forward releases them, as
  DeepSpeed does.
- ``empty_partition_cache()`` released the trained units but kept frozen ones (LoRA's base) the
  live budget holds; it releases every unit that is not persistent now, as DeepSpeed's.
- Generation without ``synced_gpus`` where every parameter is persistent (below
  ``stage3_param_persistence_threshold``: a small policy or value head): ranks run different numbers
  of no-grad forwards, which gather nothing, so DeepSpeed trains on; zeroshard counted those units in
  the window's gather sequence and raised a false disagreement at the next backward.
"""

from __future__ import annotations

import itertools

import torch
from harness import run_distributed
from models import gathered_weights, make_data, make_model, micro_batch, reference_by_micro_batch, relative_distance

import zeroshard
from zeroshard.zero.param_status import ZeroParamStatus

STEPS, GA, GLOBAL_BATCH, LR, CLIP, WORLD = 3, 1, 8, 1e-2, 1.0, 2
TOL = 1e-5
ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": 0}


def _config(optimizer: bool = True) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // (GA * WORLD), "gradient_accumulation_steps": GA,
           "gradient_clipping": CLIP, "zero_optimization": ZERO3}
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}
    return cfg


def _trl_remove_hooks(engine: zeroshard.ZeroEngine) -> None:
    """TRL's ``remove_hooks`` (trl/models/utils.py), call for call."""
    offload = engine.optimizer.parameter_offload
    params = itertools.chain(offload.module.named_parameters(recurse=True), offload.module.ds_external_parameters())
    for _, param in params:
        param.ds_active_sub_modules.clear()
    for hook in offload.forward_hooks:
        hook.remove()
    for hook in offload.backward_hooks:
        hook.remove()
    offload.forward_hooks = []
    offload.backward_hooks = []


def _trl_add_hooks(engine: zeroshard.ZeroEngine) -> None:
    offload = engine.optimizer.parameter_offload
    offload._register_deepspeed_module(offload.module)


def trl_worker(rank: int, world: int) -> dict:
    x, y = make_data(STEPS, GLOBAL_BATCH)
    micro_bs = GLOBAL_BATCH // (GA * world)
    engine, *_ = zeroshard.initialize(model=make_model(0), config=_config())
    for step in range(STEPS):
        with zeroshard.zero.GatheredParameters(list(engine.module.parameters())):
            _trl_remove_hooks(engine)
            with torch.no_grad():
                for _ in range(1 + 2 * rank):  # ranks "generate" different lengths: no collectives now
                    engine.module(x[step, :2], y[step, :2])
            _trl_add_hooks(engine)
        xb, yb = (micro_batch(t, step, 0, rank, world, micro_bs) for t in (x, y))
        engine.backward(engine(xb, yb))
        engine.step()
    out = gathered_weights(engine)
    engine.destroy()
    return out


def test_trl_generation_recipe_then_training_equals_plain_pytorch() -> None:
    ref = reference_by_micro_batch(lambda model, x, y: model(x, y), STEPS, GA, GLOBAL_BATCH, WORLD, LR, CLIP)
    for rank, got in enumerate(run_distributed(trl_worker, WORLD)):
        dist = relative_distance(got, ref)
        assert dist <= TOL, f"rank {rank}: {dist:.2e} from plain PyTorch"


def _gathered_numel(module: torch.nn.Module) -> int:
    return sum(p.ds_numel for p in module.parameters() if p.ds_status != ZeroParamStatus.NOT_AVAILABLE)


def reference_worker(rank: int, world: int) -> dict:
    x, y = make_data(STEPS, GLOBAL_BATCH)
    model = make_model(0).requires_grad_(False)
    engine, *_ = zeroshard.initialize(model=model, config=_config(optimizer=False))
    engine.eval()
    losses, held = [], []
    with torch.no_grad():
        for step in range(STEPS):
            losses.append(engine(x[step], y[step]).item())
            held.append(_gathered_numel(engine.module))
        # Generation inside an explicit gather of every parameter: its forwards release nothing it holds.
        with zeroshard.zero.GatheredParameters(list(engine.module.parameters())):
            gathered = [engine(x[s], y[s]).item() for s in range(STEPS)]
            held_inside = _gathered_numel(engine.module)
        held.append(_gathered_numel(engine.module))
    engine.destroy()
    return {"losses": losses, "held": held, "gathered": gathered, "held_inside": held_inside,
            "numel": sum(p.ds_numel for p in model.parameters())}


def test_a_reference_engine_releases_its_units_after_each_forward() -> None:
    x, y = make_data(STEPS, GLOBAL_BATCH)
    plain = make_model(0)
    with torch.no_grad():
        expected = [plain(x[s], y[s]).item() for s in range(STEPS)]
    for got in run_distributed(reference_worker, WORLD):
        assert got["losses"] == expected and got["gathered"] == expected
        assert got["held"] == [0] * (STEPS + 1), f"elements still gathered after each forward: {got['held']}"
        assert got["held_inside"] == got["numel"]


def lora_worker(rank: int, world: int) -> dict:
    x, y = make_data(STEPS, GLOBAL_BATCH)
    micro_bs = GLOBAL_BATCH // (GA * world)
    model = make_model(0)
    model.embed.requires_grad_(False)
    engine, *_ = zeroshard.initialize(model=model, config=_config())
    xb, yb = (micro_batch(t, 0, 0, rank, world, micro_bs) for t in (x, y))
    engine.backward(engine(xb, yb))
    engine.step()
    kept = _gathered_numel(engine.module.embed)  # frozen units the live budget holds to the next step
    engine.empty_partition_cache()
    emptied = _gathered_numel(engine.module)
    engine.destroy()
    return {"kept": kept, "emptied": emptied}


def test_empty_partition_cache_releases_frozen_units_too() -> None:
    for got in run_distributed(lora_worker, WORLD):
        assert got["kept"] > 0, "the frozen embedding was expected to stay gathered between steps"
        assert got["emptied"] == 0, f"{got['emptied']} elements still gathered after empty_partition_cache()"


def persistent_worker(rank: int, world: int) -> dict:
    x, y = make_data(STEPS, GLOBAL_BATCH)
    micro_bs = GLOBAL_BATCH // (GA * world)
    cfg = _config()
    cfg["zero_optimization"] = {"stage": 3}  # the default threshold: every parameter of the toy model is persistent
    engine, *_ = zeroshard.initialize(model=make_model(0), config=cfg)
    persistent = all(getattr(p, "ds_persist", False) for p in engine.module.parameters())
    for step in range(STEPS):
        with torch.no_grad():
            for _ in range(1 + 2 * rank):  # unsynced generation: a different number of forwards per rank
                engine(x[step, :2], y[step, :2])
        xb, yb = (micro_batch(t, step, 0, rank, world, micro_bs) for t in (x, y))
        engine.backward(engine(xb, yb))
        engine.step()
    out = gathered_weights(engine)
    engine.destroy()
    return {"weights": out, "persistent": persistent}


def test_unsynced_no_grad_forwards_of_persistent_parameters_train_on() -> None:
    ref = reference_by_micro_batch(lambda model, x, y: model(x, y), STEPS, GA, GLOBAL_BATCH, WORLD, LR, CLIP)
    for rank, got in enumerate(run_distributed(persistent_worker, WORLD)):
        assert got["persistent"], "the test needs every parameter below the persistence threshold"
        dist = relative_distance(got["weights"], ref)
        assert dist <= TOL, f"rank {rank}: {dist:.2e} from plain PyTorch"
