"""Checkpoint round trips through the public API: save at N ranks and stage s, load at M ranks
and stage t, keep training, and compare with a run that never stopped.

Phase 1 (one spawned job per world size) trains every stage (0–3) for ``K`` steps, saves, and
trains ``J`` more steps: its final weights are the uninterrupted reference of that (stage, world),
since saving does not perturb training. Phase 2 (one job per world size; the last phase-1 job
does its own) builds fresh engines (other initial weights) at every stage, loads phase-1
checkpoints into them (see :func:`sources`: every (stage, world) pair is saved and loaded,
cross-stage and cross-world, 48 resumes in all), trains ``J`` steps and returns the weights.
Resuming at the same world size and stage must be bit-identical; otherwise fp32 reduction order
differs and the bound is 1e-5 relative.

The world-2 jobs also check exact resume of everything else a checkpoint carries: the fp16 loss
scaler, bf16 training, the data loader's mid-epoch position and the RNG streams (a model with
dropout, inputs perturbed by Python's and NumPy's generators), and DeepSpeed's load semantics
(``load_module_only``, strictness, a missing ``latest``).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from harness import run_distributed
from models import make_data, make_model, micro_batch

import zeroshard

STAGES = (0, 1, 2, 3)
WORLDS = (1, 2, 4)
K, J = 3, 2
GLOBAL_BATCH, GA = 24, 2
REL_TOL = 1e-5


def config(stage: int, precision: str = "fp32") -> dict:
    return {
        "train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": GA, "gradient_clipping": 1.0,
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8, "loss_scale_window": 2},
        "bf16": {"enabled": precision == "bf16"},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 1000, "allgather_bucket_size": 2000},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
    }


def train(engine, steps: range, rank: int, world: int) -> None:
    x, y = make_data(K + J, GLOBAL_BATCH)
    mb = GLOBAL_BATCH // (GA * world)
    for step in steps:
        for m in range(GA):
            xb, yb = (micro_batch(t, step, m, rank, world, mb) for t in (x, y))
            engine.backward(engine(xb, yb))
            engine.step()


def weights(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def ckpt_dir(root: str, stage: int, world: int, precision: str = "fp32") -> str:
    return f"{root}/{precision}_s{stage}_w{world}"


# -- exact resume of the rest: data loader position and RNG streams -------------------------------
class DropoutNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.drop = torch.nn.Linear(6, 17), torch.nn.Linear(17, 3), torch.nn.Dropout(0.3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.b(self.drop(torch.tanh(self.a(x)))), y)


def loader_run(root: str, resume: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Two epochs over 44 samples (micro batch 2, 2 ranks, GA 2: 11 batches per rank per epoch);
    the uninterrupted run saves after 7 optimizer steps (mid-epoch 1), the resumed one starts there."""
    torch.manual_seed(3 if resume else 0)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(44, 6, generator=g), torch.randint(0, 3, (44,), generator=g))
    model = DropoutNet()
    cfg = {**config(2), "train_batch_size": 8}
    engine, _, loader, _ = zeroshard.initialize(model=model, config=cfg, training_data=data)
    start_epoch, seen = 0, []
    if resume:
        _, client = engine.load_checkpoint(f"{root}/loader")
        start_epoch = client["epoch"]
    for epoch in range(start_epoch, 3):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            x = x * (1 + 0.01 * random.random()) + torch.from_numpy(np.random.normal(0, 0.01, x.shape)).float()
            seen.append(float(x.sum()))
            engine.backward(engine(x, y))
            engine.step()
            if not resume and engine.global_steps == 7 and engine.micro_steps == 7 * GA:
                engine.save_checkpoint(f"{root}/loader", client_state={"epoch": epoch})
                seen.clear()
    return weights(engine), seen


def precision_runs(rank: int, world: int, root: str) -> dict[str, dict[str, torch.Tensor]]:
    """fp16 (dynamic loss scale, window 2: the scale changes during the run) and bf16, stage 2."""
    out = {}
    for precision in ("fp16", "bf16"):
        for resume in (False, True):
            engine, *_ = zeroshard.initialize(model=make_model(7 if resume else 0), config=config(2, precision))
            if resume:
                engine.load_checkpoint(ckpt_dir(root, 2, world, precision))
            else:
                train(engine, range(K), rank, world)
                engine.save_checkpoint(ckpt_dir(root, 2, world, precision))
            train(engine, range(K, K + J), rank, world)
            out[f"{precision}/{'resumed' if resume else 'reference'}"] = weights(engine)
            out[f"{precision}/{'resumed' if resume else 'reference'}/scale"] = torch.tensor(engine.cur_scale)
    return out


def save_worker(rank: int, world: int, root: str, then_load: bool) -> dict:
    out: dict = {}
    for stage in STAGES:
        engine, *_ = zeroshard.initialize(model=make_model(0), config=config(stage))
        train(engine, range(K), rank, world)
        engine.save_checkpoint(ckpt_dir(root, stage, world), client_state={"note": "k", "t": torch.arange(3)})
        train(engine, range(K, K + J), rank, world)
        out[f"s{stage}"] = weights(engine)
    if world == 2:
        out["precision"] = precision_runs(rank, world, root)
        out["loader"] = [loader_run(root, resume) for resume in (False, True)]
    if then_load:  # the last phase-1 job: every checkpoint exists now, so do phase 2 here (one spawn less)
        out["loads"] = load_worker(rank, world, root)
    return out


def semantics_checks(rank: int, world: int, root: str) -> None:
    """DeepSpeed's load_checkpoint semantics."""
    engine, *_ = zeroshard.initialize(model=make_model(5), config=config(1))
    path, client = engine.load_checkpoint(ckpt_dir(root, 2, 4), load_module_only=True)
    assert path.endswith("global_step3") and engine.global_steps == 0 and not engine.optimizer.state
    assert client["note"] == "k" and torch.equal(client["t"], torch.arange(3))
    full = zeroshard.get_fp32_state_dict_from_zero_checkpoint(ckpt_dir(root, 2, 4))
    assert all(torch.equal(p.detach(), full[n]) for n, p in engine.module.named_parameters())
    assert engine.load_checkpoint(f"{root}/not-saved-yet") == (None, None)  # DeepSpeed: a fresh start
    other, *_ = zeroshard.initialize(model=torch.nn.Linear(3, 2), config=config(2))
    with pytest.raises(zeroshard.CheckpointError, match="missing"):
        other.load_checkpoint(ckpt_dir(root, 0, 2))
    Path(f"{root}/empty").mkdir(exist_ok=True)
    assert engine.load_checkpoint(f"{root}/empty") == (None, None)
    module_extras_check(root)
    # A DeepSpeed-style checkpoint carrying a pickle payload: refused on every rank, never run.
    evil = Path(root) / "evil" / "global_step1"
    if rank == 0:
        evil.mkdir(parents=True, exist_ok=True)
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
            torch.save({"x": Payload(f"{root}/PWNED")}, evil / name)
        (evil.parent / "latest").write_text("global_step1")
    torch.distributed.barrier()
    with pytest.raises(zeroshard.CheckpointError, match="refusing to load"):
        engine.load_checkpoint(evil.parent)
    assert not Path(f"{root}/PWNED").exists()


class TiedNet(torch.nn.Module):
    """Tied embedding/head weights, BatchNorm buffers (one of them int64) and a frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.bn, self.frozen = torch.nn.Embedding(10, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.head(self.frozen(self.bn(self.emb(x)))), y)


def module_extras_check(root: str) -> None:
    """Buffers, frozen parameters and tied weights survive a save at stage 2 and a load at stage 0,
    and the consolidated state dict loads strictly into a fresh module."""
    torch.manual_seed(0)
    engine, *_ = zeroshard.initialize(model=TiedNet(), config={**config(2), "train_batch_size": 8})
    x, y = torch.randint(0, 10, (4,)), torch.randint(0, 10, (4,))
    for _ in range(GA):
        engine.backward(engine(x, y))
        engine.step()
    engine.save_checkpoint(f"{root}/tied", tag="first", save_latest=False)
    assert not Path(f"{root}/tied/latest").exists()
    saved = {k: v.clone() for k, v in engine.module.state_dict().items()}
    torch.manual_seed(1)
    other, *_ = zeroshard.initialize(model=TiedNet(), config={**config(0), "train_batch_size": 8})
    other.load_checkpoint(f"{root}/tied", tag="first")
    assert all(torch.equal(v, saved[k]) for k, v in other.module.state_dict().items())
    assert int(other.module.bn.num_batches_tracked) == GA
    fresh = TiedNet()
    fresh.load_state_dict(zeroshard.get_fp32_state_dict_from_zero_checkpoint(f"{root}/tied", tag="first"))
    assert all(torch.equal(v, saved[k]) for k, v in fresh.state_dict().items())


class Payload:
    """Pickles as ``os.system("touch <marker>")``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def sources(stage: int, world: int) -> list[tuple[int, int]]:
    """Checkpoints that the engine at (stage, world) resumes from: its own (bit-identical) and three
    with every other stage offset, each also shifted in world size by 1, 2 or 0 places. Over all
    12 loading pairs every saved pair is loaded 4 times: as itself, and from 3 other stages."""
    i = WORLDS.index(world)
    return [((stage + k) % len(STAGES), WORLDS[(i + k) % len(WORLDS)]) for k in range(len(STAGES))]


def load_worker(rank: int, world: int, root: str) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for stage in STAGES:
        # One engine per stage loads every checkpoint in turn: each load must fully replace the
        # weights, optimizer state, scheduler and counters left by the previous one.
        engine, *_ = zeroshard.initialize(model=make_model(1), config=config(stage))
        x, y = make_data(1, GLOBAL_BATCH)
        for src_stage, src_world in sources(stage, world):
            # Half a window of gradients pending: the load must drop them (they went into the next step)
            engine.backward(engine(*(micro_batch(t, 0, 0, rank, world, GLOBAL_BATCH // (GA * world)) for t in (x, y))))
            engine.step()
            _, client = engine.load_checkpoint(ckpt_dir(root, src_stage, src_world))
            assert engine.global_steps == K and engine.micro_steps == K * GA, engine.global_steps
            assert client["note"] == "k"
            train(engine, range(K, K + J), rank, world)
            out[f"{stage}<-{src_stage},{src_world}"] = weights(engine)
    if world == 2:
        semantics_checks(rank, world, root)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("ckpt"))
    return root, {world: run_distributed(save_worker, world, root, world == WORLDS[-1]) for world in WORLDS}


def _flat(d: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in d.values()])


@pytest.mark.parametrize("world", WORLDS)
def test_resume_any_stage_any_world(world: int, saved) -> None:
    root, saves = saved
    refs = {w: r[0] for w, r in saves.items()}
    if world == WORLDS[-1]:
        results = [r["loads"] for r in saves[world]]
    else:
        results = run_distributed(load_worker, world, root)
    report = []
    for key, got in results[0].items():
        stage, src = key.split("<-")
        src_stage, src_world = (int(v) for v in src.split(","))
        ref = refs[world][f"s{stage}"]
        rel = ((_flat(got) - _flat(ref)).norm() / _flat(ref).norm()).item()
        report.append(f"load stage {stage} world {world} <- stage {src_stage} world {src_world}: rel {rel:.1e}")
        if (src_stage, src_world) == (int(stage), world):
            assert all(torch.equal(got[n], ref[n]) for n in ref), report[-1] + " (must be bit-identical)"
        assert rel <= REL_TOL, report[-1]
        for other in results[1:]:
            assert all(torch.equal(got[n], other[key][n]) for n in got), f"{key}: ranks disagree"
    print("\n".join(report))


def test_exact_resume_of_scaler_precision_loader_and_rng(saved) -> None:
    refs = {w: r[0] for w, r in saved[1].items()}
    runs = refs[2]["precision"]
    for precision in ("fp16", "bf16"):
        ref, got = runs[f"{precision}/reference"], runs[f"{precision}/resumed"]
        assert all(torch.equal(ref[n], got[n]) for n in ref), precision
        assert torch.equal(runs[f"{precision}/reference/scale"], runs[f"{precision}/resumed/scale"])
    (ref_w, ref_seen), (got_w, got_seen) = refs[2]["loader"]
    assert len(got_seen) == len(ref_seen) > 0 and got_seen == ref_seen, "batches or RNG draws differ after resume"
    assert all(torch.equal(ref_w[n], got_w[n]) for n in ref_w)


def test_consolidated_export(saved, tmp_path: Path) -> None:
    """The phase-1 checkpoints, consolidated in this process: the state dict API, the model loader,
    and ``zeroshard convert`` to one file, to bf16, and to Hugging Face shards with an index."""
    from safetensors.torch import load_file

    from zeroshard.cli.main import main as cli

    root, _ = saved
    full = zeroshard.get_fp32_state_dict_from_zero_checkpoint(ckpt_dir(root, 2, 4))
    assert list(full) == [n for n, _ in make_model(0).named_parameters()]
    for stage in STAGES:  # the same training, saved by 1, 2 or 4 ranks: the same weights
        for world in WORLDS:
            other = zeroshard.get_fp32_state_dict_from_zero_checkpoint(ckpt_dir(root, stage, world), tag="global_step3")
            rel = (_flat(other) - _flat(full)).norm() / _flat(full).norm()
            assert rel <= REL_TOL, (stage, world, rel.item())
    model = zeroshard.load_state_dict_from_zero_checkpoint(make_model(3), ckpt_dir(root, 2, 4))
    assert all(torch.equal(p.detach(), full[n]) for n, p in model.named_parameters())
    assert cli(["convert", ckpt_dir(root, 2, 4), str(tmp_path / "one.safetensors"), "-q"]) == 0
    assert all(torch.equal(v, full[k]) for k, v in load_file(tmp_path / "one.safetensors").items())
    assert cli(["convert", ckpt_dir(root, 0, 2), str(tmp_path / "bf16.safetensors"), "--dtype", "bf16", "-q"]) == 0
    half = load_file(tmp_path / "bf16.safetensors")
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, full[k].bfloat16()) for k, v in half.items())
    assert cli(["convert", ckpt_dir(root, 3, 1), str(tmp_path / "hf"), "--max-shard-size", "2KB", "-q"]) == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    shards = {k: v for f in files for k, v in load_file(tmp_path / "hf" / f).items()}
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in shards.values())
    assert shards.keys() == full.keys() and all((shards[k] - full[k]).norm() <= 1e-5 * full[k].norm() for k in full)


def test_damaged_checkpoint_is_named(saved, tmp_path: Path) -> None:
    """A shard cut short after publication (disk trouble, a bad copy) is refused, naming the file."""
    import shutil

    root, _ = saved
    copy = tmp_path / "copy"
    shutil.copytree(ckpt_dir(root, 1, 2), copy)
    shard = copy / "global_step3" / "rank-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(zeroshard.CheckpointError, match=r"rank-00001-of-00002\.safetensors is \d+ bytes instead of"):
        zeroshard.get_fp32_state_dict_from_zero_checkpoint(copy)
    (copy / "global_step3" / "COMPLETE").unlink()
    with pytest.raises(zeroshard.CheckpointError, match=r"global_step3 is an incomplete zeroshard checkpoint"):
        zeroshard.get_fp32_state_dict_from_zero_checkpoint(copy)
