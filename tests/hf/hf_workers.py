"""Spawned workers of the Hugging Face contract tests (``tests/hf/test_hf_*.py``).

Each worker enables ``zeroshard.deepspeed.imports`` *before* importing transformers or accelerate
(they decide at import whether DeepSpeed is there), so nothing Hugging Face is imported at the top
of this module. The real DeepSpeed is installed with the test extras, hence ``shadow=True``.

Without CUDA, accelerate picks no process-group backend for DeepSpeed (its ``PartialState`` then
counts one process), so every worker first creates accelerate's state itself with gloo and the
Trainer reuses it (``accelerator_config={"use_configured_state": True}``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

STAGES = (0, 1, 2, 3)
MICRO, GAS, STEPS, SAVE_AT, SEQ, VOCAB = 2, 2, 6, 3, 16, 128
RESIZE_BY, RESIZE_SEED = 8, 5  # resize_token_embeddings: rows added, seed of their initialisation
#: Trainer runs with offload (first run only, not resumed): name -> (stage, optimizer device, parameter device)
OFFLOAD = {"stage2_offload_cpu": (2, "cpu", "none"), "stage3_offload_nvme": (3, "nvme", "nvme")}


def enable_layer() -> None:
    import zeroshard.deepspeed.imports as layer

    layer.enable(shadow=True)


def token_rows(n: int, seed: int) -> torch.Tensor:
    """``n`` learnable sequences: each counts up by one from a random start (mod the vocabulary)."""
    start = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(seed))
    return (start + torch.arange(SEQ)) % VOCAB


def auto_config(stage: int, offload: tuple[str, str] = ("none", "none"), nvme_path: str = "") -> dict[str, Any]:
    """A DeepSpeed config full of ``"auto"``, as in Hugging Face's documentation; ``offload`` is the
    (optimizer, parameter) device of ``offload_optimizer`` / ``offload_param`` (``nvme`` under ``nvme_path``)."""
    config = {
        "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                           "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto",
                              "stage3_gather_16bit_weights_on_model_save": True},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
    }
    for key, device in zip(("offload_optimizer", "offload_param"), offload, strict=True):
        if device != "none":
            config["zero_optimization"][key] = {"device": device, "nvme_path": nvme_path}
    return config


def fresh_accelerate_state() -> None:
    """Forget the previous run's accelerate state; create it for DeepSpeed over gloo."""
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")


def _partitioned(model: torch.nn.Module, world: int, frozen_only: bool = False) -> bool:
    """Every parameter (every frozen one) is a ZeRO-3 placeholder carrying DeepSpeed's attributes,
    holding only this rank's chunk."""
    from zeroshard.core.partition import INIT_CHUNK_ATTR, full_shape

    for p in model.parameters():
        if frozen_only and p.requires_grad:
            continue
        chunk = getattr(p, INIT_CHUNK_ATTR, None)
        if p.numel() != 0 or chunk is None or not hasattr(p, "ds_id") or p.ds_shape != full_shape(p):
            return False
        if p.ds_numel != full_shape(p).numel():
            return False
        if chunk.numel() > -(-p.ds_numel // world) or p.partition_numel() != -(-p.ds_numel // world):
            return False
    return True


def _step_log() -> Any:
    """A Trainer callback recording the optimizer steps this process ran and the losses it logged."""
    from transformers import TrainerCallback

    class StepLog(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[int] = []
            self.losses: list[float] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.steps.append(state.global_step)

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    return StepLog()


def trainer_worker(rank: int, world: int, root: str, resume: bool) -> dict[str, Any]:
    """The Trainer at every stage from ``root/init``: a first run (saving at SAVE_AT and at the end),
    or, with ``resume``, a new run resumed from the first run's checkpoint at SAVE_AT."""
    enable_layer()
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    rows = token_rows(world * MICRO * GAS * STEPS, seed=1)
    data = [{"input_ids": r, "labels": r} for r in rows]
    out: dict[str, Any] = {}
    cases = {f"stage{stage}": (stage, "none", "none") for stage in STAGES} | ({} if resume else OFFLOAD)
    for name, (stage, opt_device, param_device) in cases.items():
        fresh_accelerate_state()
        run = f"{root}/{name}" + ("/resumed_run" if resume else "")
        # every rank names the same nvme_path (the configs must agree); each gets its own swap directory
        config = auto_config(stage, (opt_device, param_device), f"{root}/nvme")
        args = TrainingArguments(
            output_dir=run, deepspeed=config, accelerator_config={"use_configured_state": True},
            per_device_train_batch_size=MICRO, gradient_accumulation_steps=GAS, max_steps=STEPS, save_steps=SAVE_AT,
            learning_rate=3e-3, adam_beta2=0.98, adam_epsilon=1e-7, weight_decay=0.01, max_grad_norm=0.5,
            warmup_steps=1, logging_steps=1, report_to=[], seed=0, disable_tqdm=True)
        model = AutoModelForCausalLM.from_pretrained(f"{root}/init")  # stage 3: built under zero.Init
        partitioned = _partitioned(model, world)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        if resume:
            seen = _step_log()
            trainer.add_callback(seen)
            trainer.train(resume_from_checkpoint=f"{root}/{name}/checkpoint-{SAVE_AT}")
            trainer.save_model(f"{root}/{name}/resumed")
            out[name] = {"steps_run": seen.steps, "losses": seen.losses}
            continue
        trainer.train()
        trainer.save_model(f"{root}/{name}/final")
        engine = trainer.model_wrapped
        opt = engine.optimizer.param_groups[0]
        sched = engine.config.scheduler.params
        out[name] = {
            # where the optimizer state and the parameter shard live: bytes by place (offload runs)
            "placement": engine.optimizer.memory_placement() if name in OFFLOAD else {},
            "partitioned": partitioned,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "resolved": {"micro": engine.train_micro_batch_size_per_gpu(), "gas": engine.gradient_accumulation_steps(),
                         "train_batch": engine.train_batch_size(), "clip": engine.gradient_clipping(),
                         "betas": list(opt["betas"]), "eps": opt["eps"], "weight_decay": opt["weight_decay"],
                         "warmup_max_lr": sched["warmup_max_lr"], "total_num_steps": sched["total_num_steps"],
                         "warmup_num_steps": sched["warmup_num_steps"], "stage": engine.zero_optimization_stage()},
        }
    return out


def _batch(step: int, micro: int, rank: int, world: int) -> torch.Tensor:
    rows = token_rows(world * MICRO * GAS * STEPS, seed=2)
    first = ((step * GAS + micro) * world + rank) * MICRO
    return rows[first:first + MICRO]


def parity_config(stage: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}}


def reference_parameters(model: torch.nn.Module, world: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch on one process, same global batches: the mean loss over ranks and micro-steps;
    AdamW over the parameters that require gradients."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    for step in range(STEPS):
        total = sum(model(input_ids=b, labels=b).loss for r in range(world) for m in range(GAS)
                    for b in [_batch(step, m, r, world)])
        (total / (world * GAS)).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(engine: Any, rank: int, world: int) -> None:
    """The parity run's steps on this rank's micro-batches."""
    for step in range(STEPS):
        for micro in range(GAS):
            ids = _batch(step, micro, rank, world)
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()


def _trained_at_stage3(model: torch.nn.Module, rank: int, world: int) -> dict[str, torch.Tensor]:
    import zeroshard
    from zeroshard.zero import GatheredParameters

    engine, *_ = zeroshard.initialize(model=model, config=parity_config(3))
    _train(engine, rank, world)
    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def engine_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    """After the Trainer: parity of ``initialize`` on a transformers model at every stage, ZeRO-3
    ``from_pretrained`` under a live ``HfDeepSpeedConfig``, and accelerate's loop at stages 2 and 3."""
    enable_layer()
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    import zeroshard
    from zeroshard.zero import GatheredParameters

    out: dict[str, Any] = {"parity": {}}
    for stage in STAGES:
        model = AutoModelForCausalLM.from_pretrained(f"{root}/init")
        engine, *_ = zeroshard.initialize(model=model, config=parity_config(stage))
        _train(engine, rank, world)
        with GatheredParameters(list(model.parameters())):
            out["parity"][stage] = {n: p.detach().clone() for n, p in model.named_parameters()}

    cfg3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
    live = HfDeepSpeedConfig(cfg3)  # kept alive: from_pretrained builds under zero.Init while it exists
    model = AutoModelForCausalLM.from_pretrained(f"{root}/stage3/final")
    out["z3_partitioned"] = _partitioned(model, world)
    with GatheredParameters(list(model.parameters())):
        out["z3_loaded"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = zeroshard.initialize(model=model, config=cfg3)
    engine.eval()
    with torch.no_grad():
        out["z3_logits"] = engine(input_ids=token_rows(2, seed=3)).logits

    # resize_token_embeddings on a partitioned model, then training: transformers builds the new
    # embedding and head whole and copies the old rows in under ``GatheredParameters([w, w'])``, the
    # head's as ``GatheredParameters([w, None, w', None])`` (no biases)
    model = AutoModelForCausalLM.from_pretrained(f"{root}/init")
    torch.manual_seed(RESIZE_SEED)
    model.resize_token_embeddings(VOCAB + RESIZE_BY, mean_resizing=False)
    with GatheredParameters(list(model.parameters())):
        out["resized"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["resized_trained"] = _trained_at_stage3(model, rank, world)
    del live
    model = AutoModelForCausalLM.from_pretrained(f"{root}/init")  # whole: ZeRO-3 is off in transformers now
    torch.manual_seed(RESIZE_SEED)
    model.resize_token_embeddings(VOCAB + RESIZE_BY, mean_resizing=False)
    out["resized_whole_trained"] = _trained_at_stage3(model, rank, world)
    out["accelerate"] = accelerate_loop(rank, world, root)
    return out


def accelerate_loop(rank: int, world: int, root: str) -> dict[int, list[float]]:
    """accelerate's own loop (prepare, backward, step) with a DeepSpeedPlugin at stages 2 and 3."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from transformers import AutoModelForCausalLM

    losses: dict[int, list[float]] = {}
    rows = token_rows(world * MICRO * STEPS, seed=4)
    for stage in (2, 3):
        fresh_accelerate_state()
        plugin = DeepSpeedPlugin(hf_ds_config={
            "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage}})
        accelerator = Accelerator(deepspeed_plugin=plugin)
        model = AutoModelForCausalLM.from_pretrained(f"{root}/init")
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        loader = torch.utils.data.DataLoader(rows, batch_size=MICRO)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        losses[stage] = []
        for ids in loader:
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses[stage].append(float(loss))
    return losses


def lora(model: torch.nn.Module) -> torch.nn.Module:
    """PEFT's LoRA on the attention's query and value projections, the same adapters in every process."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(7)  # the adapters' random initialisation, whatever consumed the generator before
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                            init_lora_weights="gaussian"))


def peft_reference(root: str, world: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch on one process: LoRA on the unsharded model, AdamW over the adapters, the same global batches."""
    from transformers import AutoModelForCausalLM

    return reference_parameters(lora(AutoModelForCausalLM.from_pretrained(f"{root}/init")), world)


def peft_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    """LoRA fine-tuning as PEFT users run it under ZeRO-3: ``from_pretrained`` under a live
    ``HfDeepSpeedConfig`` (the base weights arrive partitioned by ``zero.Init``), ``get_peft_model``,
    then ``initialize`` with the trainable parameters; the same at stage 2 without zero.Init."""
    enable_layer()
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    import zeroshard
    from zeroshard.zero import GatheredParameters

    out: dict[str, Any] = {}
    for stage in (2, 3):
        cfg = parity_config(stage)
        live = HfDeepSpeedConfig(cfg) if stage == 3 else None  # from_pretrained under zero.Init while alive
        model = lora(AutoModelForCausalLM.from_pretrained(f"{root}/init"))
        out[f"partitioned_{stage}"] = _partitioned(model, world, frozen_only=True)
        engine, *_ = zeroshard.initialize(model=model, config=cfg,
                                          model_parameters=[p for p in model.parameters() if p.requires_grad])
        _train(engine, rank, world)
        # what the rank keeps of the frozen base: its chunks at stage 3, nothing of the kind below
        out[f"frozen_shard_{stage}"] = engine.memory_usage().get("frozen_parameter_shard", 0)
        with GatheredParameters(list(model.parameters())):
            out[stage] = {n: p.detach().clone() for n, p in model.named_parameters()}
            out["frozen_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
        engine.destroy()
        del live
    return out
