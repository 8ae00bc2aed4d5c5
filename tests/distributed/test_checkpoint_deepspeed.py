"""DeepSpeed 0.19 checkpoints: consolidated by zeroshard exactly as by DeepSpeed's ``zero_to_fp32``,
and resumed by zeroshard engines at other world sizes and stages, optimizer state included.

A session fixture runs real DeepSpeed once (2 ranks, CPU) with its default optimizer (FusedAdam,
JIT-compiled by DeepSpeed on first use, about a minute on a fresh machine; it stores Adam's
``step`` as a Python int) at ZeRO stages 1, 2, 3 in fp32 and stages 2 and 3 in bf16 (whose files
carry the ``bf16_`` prefix), with ``torch_adam`` (``step`` as a tensor) at stage 2, and at stage
3 with two param groups (decay / no decay) and a ``sub_group_size`` that cuts one into two. Each
trains ``K`` steps and saves, trains ``J`` more and saves a ``final`` tag; DeepSpeed's own
``zero_to_fp32`` consolidates both tags inside that job. Two more runs (stages 2 and 3) save a
model with BatchNorm buffers, an untrained layer and tied weights, and a last one uses DeepSpeed's
BF16_Optimizer (stage 1, bf16, fp32 accumulation), whose files ``zero_to_fp32`` itself rejects.
zeroshard then reads the checkpoints in this process (no DeepSpeed import needed: a subprocess
with ``deepspeed`` unimportable converts one), and resumes each fp32 checkpoint at world sizes 1
and 4 in stages 0–3: after ``J`` steps the weights must match DeepSpeed's ``final`` to fp32
reduction-order noise.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from models import make_data, make_model, micro_batch

import zeroshard
from zeroshard.cli.main import main as cli

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="DeepSpeed is not installed (pip install zeroshard[deepspeed])")

K, J, GLOBAL_BATCH, GA = 3, 2, 24, 2
DS_RUNS = {"s1_fp32": (1, "fp32"), "s2_fp32": (2, "fp32"), "s3_fp32": (3, "fp32"), "s2_bf16": (2, "bf16"),
           "s3_bf16": (3, "bf16"), "s2_fp32_torch_adam": (2, "fp32"), "s3_fp32_subgroups": (3, "fp32")}
BF16_RUNS = ("s2_bf16", "s3_bf16")
#: param groups as Hugging Face scripts make them, and a sub_group_size under which ZeRO-3 cuts the
#: decay group into two flat sub-groups (per-rank chunks 204 + 537, then 73 elements at world 2)
GROUPED_RUNS = {"s3_fp32_subgroups": 300}
REL_TOL = 1e-5


def grouped(model: torch.nn.Module) -> list[dict]:
    """Weight decay on the matrices only (biases and the LayerNorm without), as transformers' Trainer."""
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def ds_config(stage: int, precision: str, torch_adam: bool = False) -> dict:
    """DeepSpeed's defaults but for the batch, clipping and schedule: without ``torch_adam`` its
    AdamW is FusedAdam, as for most users."""
    params = {"lr": 1e-2, "weight_decay": 0.01, **({"torch_adam": True} if torch_adam else {})}
    return {
        "train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": GA, "gradient_clipping": 1.0,
        "bf16": {"enabled": precision == "bf16"}, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": params},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
        "steps_per_print": 10_000,
    }


def train(engine, steps: range, rank: int, world: int, dtype: torch.dtype = torch.float32) -> None:
    x, y = make_data(K + J, GLOBAL_BATCH)
    for step in steps:
        for m in range(GA):
            xb, yb = (micro_batch(t, step, m, rank, world, GLOBAL_BATCH // (GA * world)) for t in (x, y))
            engine.backward(engine(xb.to(dtype), yb))
            engine.step()


class ExtrasNet(torch.nn.Module):
    """BatchNorm buffers, an untrained layer and (optionally) tied input/output embeddings."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.emb, self.bn, self.frozen = torch.nn.Embedding(10, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(6, 10, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.head(self.frozen(self.bn(self.emb(x)))), y)


EXTRAS_RUNS = {"s2_extras": (2, True), "s3_extras": (3, False)}


def deepspeed_worker(rank: int, world: int, root: str) -> dict:
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as ds_fp32

    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce kernel on first use (~30 s
    # without a warm torch_extensions cache); it only speeds up communication, and gloo does the
    # same job here, so skip building it. The checkpoint files do not depend on it.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # (deepspeed.comm.torch is torch)

    out = {}
    for name, (stage, precision) in DS_RUNS.items():
        model = make_model(0)
        config = ds_config(stage, precision, torch_adam=name.endswith("torch_adam"))
        if name in GROUPED_RUNS:
            config["zero_optimization"]["sub_group_size"] = GROUPED_RUNS[name]
        params = grouped(model) if name in GROUPED_RUNS else model.parameters()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config)
        if name in GROUPED_RUNS:
            assert len(engine.optimizer.fp32_partitioned_groups_flat) == 3, name  # 2 + 1 sub-groups
        inner = type(engine.optimizer.optimizer).__name__
        assert inner == ("AdamW" if name.endswith("torch_adam") else "FusedAdam"), (name, inner)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        train(engine, range(K), rank, world, dtype)
        engine.save_checkpoint(f"{root}/{name}", client_state={"epoch": 7})
        train(engine, range(K, K + J), rank, world, dtype)
        engine.save_checkpoint(f"{root}/{name}", tag="final", save_latest=False)
        torch.distributed.barrier()
        if rank == 0:
            out[name] = {tag: {k: v.clone() for k, v in ds_fp32(f"{root}/{name}", tag=tag).items()}
                         for tag in (f"global_step{K}", "final")}
    for name, (stage, tied) in EXTRAS_RUNS.items():
        torch.manual_seed(0)
        model = ExtrasNet(tied)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(stage, "fp32"))
        for _ in range(GA):
            engine.backward(engine(torch.randint(0, 10, (6,)), torch.randint(0, 10, (6,))))
            engine.step()
        engine.save_checkpoint(f"{root}/{name}")
        torch.distributed.barrier()
        if rank == 0:
            out[name] = {"global_step1": {k: v.clone() for k, v in ds_fp32(f"{root}/{name}").items()}}
    # bf16 at stage 1 with fp32 gradient accumulation selects DeepSpeed's BF16_Optimizer, whose
    # checkpoints DeepSpeed's zero_to_fp32 rejects ("is not a zero checkpoint"): keep its bf16 weights.
    model = make_model(0)
    cfg = {**ds_config(1, "bf16"), "data_types": {"grad_accum_dtype": "fp32"}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    assert type(engine.optimizer).__name__ == "BF16_Optimizer"
    train(engine, range(K), rank, world, torch.bfloat16)
    engine.save_checkpoint(f"{root}/s1_bf16_optimizer")
    out["s1_bf16_optimizer"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return out


@pytest.fixture(scope="session")
def ds_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("deepspeed")
    return root, run_distributed(deepspeed_worker, 2, str(root), timeout=600)[0]


def test_consolidation_matches_zero_to_fp32(ds_checkpoints, tmp_path: Path) -> None:
    root, refs = ds_checkpoints
    for name in (*DS_RUNS, *EXTRAS_RUNS):  # the extras: buffers, untrained and tied parameters
        ref = refs[name][f"global_step{K}"] if name in DS_RUNS else refs[name]["global_step1"]
        got = zeroshard.get_fp32_state_dict_from_zero_checkpoint(root / name)
        assert sorted(got) == sorted(ref), name
        assert all(torch.equal(got[k], ref[k]) for k in ref), name
        if name in EXTRAS_RUNS:
            ExtrasNet(EXTRAS_RUNS[name][1]).load_state_dict(got)  # strict: every key, tied ones too
            continue
        final = zeroshard.get_fp32_state_dict_from_zero_checkpoint(root / name, tag="final")
        assert all(torch.equal(final[k], refs[name]["final"][k]) for k in ref), name
        out = tmp_path / f"{name}.safetensors"
        assert cli(["convert", str(root / name), str(out), "--quiet"]) == 0
        from safetensors.torch import load_file

        assert all(torch.equal(load_file(out)[k], ref[k]) for k in ref), name


def test_bf16_optimizer_checkpoint(ds_checkpoints) -> None:
    """Consolidated fp32 masters that round to exactly DeepSpeed's bf16 module weights."""
    root, refs = ds_checkpoints
    got = zeroshard.get_fp32_state_dict_from_zero_checkpoint(root / "s1_bf16_optimizer")
    bf16 = refs["s1_bf16_optimizer"]
    assert got.keys() == bf16.keys() and all(torch.equal(got[k].bfloat16(), bf16[k]) for k in bf16)
    assert any(not torch.equal(got[k], bf16[k].float()) for k in bf16), "expected fp32 masters, got bf16 values"


def test_conversion_needs_no_deepspeed(ds_checkpoints, tmp_path: Path) -> None:
    root, refs = ds_checkpoints
    code = (
        "import sys; sys.modules['deepspeed'] = None\n"  # any `import deepspeed` now fails
        "import torch, zeroshard\n"
        f"sd = zeroshard.get_fp32_state_dict_from_zero_checkpoint({str(root / 's3_fp32')!r})\n"
        f"torch.save(sd, {str(tmp_path / 'sd.pt')!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    got = torch.load(tmp_path / "sd.pt", weights_only=True)
    assert all(torch.equal(got[k], v) for k, v in refs["s3_fp32"][f"global_step{K}"].items())


#: zeroshard stages that resume the DeepSpeed checkpoints, per world size (together: all of 0-3).
RESUME_STAGES = {1: (0, 2), 4: (1, 3)}


def resume_worker(rank: int, world: int, root: str) -> dict:
    out = {}
    cfg = {k: v for k, v in ds_config(0, "fp32").items() if k != "steps_per_print"}
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
    for stage in RESUME_STAGES[world]:
        engine, *_ = zeroshard.initialize(model=make_model(4), config={**cfg, "zero_optimization": {"stage": stage}})
        model = make_model(4)
        grouped_engine, *_ = zeroshard.initialize(model=model, model_parameters=grouped(model),
                                                  config={**cfg, "zero_optimization": {"stage": stage}})
        for name in ("s1_fp32", "s2_fp32", "s3_fp32", "s2_fp32_torch_adam", *GROUPED_RUNS):
            e = grouped_engine if name in GROUPED_RUNS else engine
            path, client = e.load_checkpoint(f"{root}/{name}")
            assert e.global_steps == K and client["epoch"] == 7, (e.global_steps, sorted(client))
            assert e.lr_scheduler.state_dict()["last_batch_iteration"] == K - 1
            assert len(e.optimizer.state) == len(list(e.module.parameters()))
            train(e, range(K, K + J), rank, world)
            out[f"{name}->stage{stage}"] = {n: p.detach().clone() for n, p in e.module.named_parameters()}
    for name in BF16_RUNS:
        engine, *_ = zeroshard.initialize(model=make_model(4), config={**cfg, "bf16": {"enabled": True}})
        engine.load_checkpoint(f"{root}/{name}")
        out[f"bf16 masters {name}"] = {n: m.detach().clone() for n, m in ((n, engine.optimizer.master.views[p])
                                                                          for n, p in engine.module.named_parameters())}
    return out


@pytest.mark.parametrize("world", sorted(RESUME_STAGES))
def test_resume_deepspeed_checkpoint_in_zeroshard(world: int, ds_checkpoints) -> None:
    root, refs = ds_checkpoints
    result = run_distributed(resume_worker, world, str(root))[0]
    report = []
    for key, got in result.items():
        if key.startswith("bf16 masters"):
            continue
        ref = refs[key.split("->")[0]]["final"]
        flat = torch.cat([(got[n] - ref[n]).reshape(-1) for n in ref]).norm()
        rel = (flat / torch.cat([ref[n].reshape(-1) for n in ref]).norm()).item()
        report.append(f"DeepSpeed {key} at world {world}: rel {rel:.1e}")
        assert rel <= REL_TOL, report[-1]
    if world == 1:  # the whole master is local at world 1: it is DeepSpeed's fp32 master, bit for bit
        for name in BF16_RUNS:
            ref = refs[name][f"global_step{K}"]
            assert all(torch.equal(result[f"bf16 masters {name}"][n].view(ref[n].shape), ref[n]) for n in ref), name
    print("\n".join(report))


def extras_worker(rank: int, world: int, root: str) -> dict:
    """DeepSpeed's checkpoints with a frozen layer, loaded at zeroshard's stage 3, which partitions
    it: each rank reads its chunk of the frozen weights (stage 3's ``frozen_param_fragments``, stage
    2's whole module weights)."""
    out = {}
    cfg = {k: v for k, v in ds_config(3, "fp32").items() if k not in ("steps_per_print", "scheduler")}
    cfg["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    for name, (_stage, tied) in EXTRAS_RUNS.items():
        torch.manual_seed(1)  # other initial values than the checkpoint's
        model = ExtrasNet(tied)
        trained = [p for p in model.parameters() if p.requires_grad]
        engine, *_ = zeroshard.initialize(model=model, model_parameters=trained, config=cfg)
        assert model.frozen.weight in engine.optimizer.frozen.ranges  # partitioned, not whole
        engine.load_checkpoint(f"{root}/{name}", load_optimizer_states=False, load_lr_scheduler_states=False)
        with engine.gathered():
            out[name] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return out


def test_zeroshard_stage3_partitions_deepspeed_frozen_parameters(ds_checkpoints) -> None:
    root, refs = ds_checkpoints
    for world in (2, 3):
        result = run_distributed(extras_worker, world, str(root))[0]
        for name in EXTRAS_RUNS:
            ref = refs[name]["global_step1"]
            for n, v in result[name].items():
                assert torch.equal(v, ref[n]), (world, name, n)
