"""Checkpoints of a LoRA fine-tune whose frozen base ZeRO-3 partitions, resumed by training on.

A stage-3 run on 2 ranks, built under ``zero.Init`` (as transformers' ZeRO-3 ``from_pretrained``
does), saves after ``K`` steps and trains on to ``K + J``. Each rank's file holds its chunk of the
frozen parameters, not the whole of them. The checkpoint is resumed at stage 3 on 2 and 1 ranks
and at stage 2 on 2 ranks (the global batch kept by the accumulation steps) and trained on for
``J`` steps: the trained parameters must reach the uninterrupted run's within fp32 reduction noise
and the frozen ones must come out bit-identical to their initial values. ``zero_to_fp32`` and a
version-1 checkpoint (frozen parameters stored whole in ``extra.safetensors``, as zeroshard wrote
before it partitioned them) give the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from lora_model import build, check_lora, data, trains
from models import gathered_weights
from safetensors import safe_open

import zeroshard
from zeroshard.checkpoint.paths import marker_text
from zeroshard.checkpoint.safetensors_io import CRC_KEY, TensorSpec, write_safetensors
from zeroshard.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

K, J, MB, SAMPLES, LR = 3, 3, 3, 12, 1e-2
TOL = 1e-5


def _config(stage: int, world: int, persistence: int = 0, nvme: str | None = None) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": persistence}
    if nvme is not None:  # everything in swap files: the frozen chunks in one of their own
        zero.update(sub_group_size=100, offload_optimizer={"device": "nvme", "nvme_path": nvme},
                    offload_param={"device": "nvme", "nvme_path": nvme})
    return {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": SAMPLES // (MB * world),
            "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": zero}


def _engine(stage: int, world: int, persistence: int = 0, nvme: str | None = None) -> Any:
    m = build("device" if stage == 3 else None)
    engine, *_ = zeroshard.initialize(model=m, model_parameters=[p for p in m.parameters() if p.requires_grad],
                                      config=_config(stage, world, persistence, nvme))
    return engine


def _train(engine: Any, steps: range, rank: int, world: int) -> None:
    x, y = data((K + J) * SAMPLES)
    for s in steps:
        for g in range(SAMPLES // (MB * world)):  # micro-batches dealt by micro-step, then by rank
            rows = slice(s * SAMPLES + (g * world + rank) * MB, s * SAMPLES + (g * world + rank + 1) * MB)
            engine.backward(F.cross_entropy(engine(x[rows]), y[rows]))
            engine.step()


def save_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    engine = _engine(3, world)
    _train(engine, range(K), rank, world)
    engine.save_checkpoint(root, tag="lora")
    at_save = gathered_weights(engine)
    _train(engine, range(K, K + J), rank, world)
    out = {"at_save": at_save, "final": gathered_weights(engine)}
    engine.destroy()
    # The same K steps with the frozen chunks (and everything else) in swap files, saved from there.
    engine = _engine(3, world, nvme=str(Path(root) / "swap"))
    _train(engine, range(K), rank, world)
    engine.save_checkpoint(str(Path(root) / "from_nvme"), tag="lora")
    engine.destroy()
    return out


def resume_worker(rank: int, world: int, root: str, stage: int, persistence: int,
                  nvme: str | None) -> dict[str, torch.Tensor]:
    engine = _engine(stage, world, persistence, nvme)
    frozen = [p for n, p in engine.module.named_parameters() if not trains(n)]
    with zeroshard.zero.GatheredParameters(frozen, modifier_rank=0):  # live values the load must replace
        for p in frozen:
            p.data.add_(1.0)
    engine.load_checkpoint(root, tag="lora")
    _train(engine, range(K, K + J), rank, world)
    out = gathered_weights(engine)
    engine.destroy()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("lora")
    (root / "swap").mkdir()
    return root, run_distributed(save_worker, 2, str(root))[0]


def test_each_rank_file_holds_its_chunk_of_the_frozen_parameters(saved: tuple[Path, dict[str, Any]]) -> None:
    root, _ = saved
    frozen = {n: p.numel() for n, p in build().named_parameters() if not trains(n)}
    meta = json.loads((root / "lora" / "zeroshard.json").read_text())
    assert sorted(p["name"] for p in meta["frozen_params"]) == sorted(frozen) and not meta["frozen"]
    for rank in range(2):
        with safe_open(str(root / "lora" / f"rank-{rank:05d}-of-00002.safetensors"), "pt") as f:
            held = {k.removeprefix("frozen/"): f.get_slice(k).get_shape()[0]
                    for k in f.keys() if k.startswith("frozen/")}
        # ceil(numel / 2) elements on rank 0, the rest on rank 1
        assert held == {n: (numel + 1) // 2 if rank == 0 else numel // 2 for n, numel in frozen.items()}, held
    with safe_open(str(root / "lora" / "extra.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if k.startswith("frozen/")]


@pytest.mark.parametrize(("stage", "world", "persistence", "nvme"),
                         [(3, 2, 0, False), (3, 1, 0, False), (2, 2, 0, False), (3, 2, 1000, False), (3, 2, 0, True)])
def test_resume_trains_on_as_the_uninterrupted_run(stage: int, world: int, persistence: int, nvme: bool,
                                                   saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """The frozen parameters are changed before the load, which must replace them (with persistence
    1000 the small frozen units stay gathered, and the load must refresh them; with NVMe it writes
    their swap file)."""
    root, ref = saved
    swap = str(tmp_path) if nvme else None
    check_lora(run_distributed(resume_worker, world, str(root), stage, persistence, swap)[0], ref["final"], TOL)
    assert not any(tmp_path.iterdir()), "swap files were left behind"


def test_a_save_from_swap_files_holds_the_same_values(saved: tuple[Path, dict[str, Any]]) -> None:
    """The checkpoint saved with every state in swap files (the frozen chunks read from theirs)
    holds exactly what the in-memory run's holds: offload is bit-identical."""
    root, _ = saved
    for rank in range(2):
        name = f"rank-{rank:05d}-of-00002.safetensors"
        with safe_open(str(root / "lora" / name), "pt") as a, safe_open(str(root / "from_nvme" / "lora" / name),
                                                                        "pt") as b:
            keys = [k for k in a.keys() if k.startswith(("frozen/", "master/", "optim/"))]
            assert keys and set(keys) == {k for k in b.keys() if k.startswith(("frozen/", "master/", "optim/"))}
            for k in keys:
                assert torch.equal(a.get_tensor(k), b.get_tensor(k)), (rank, k)


def test_zero_to_fp32_has_the_frozen_parameters(saved: tuple[Path, dict[str, Any]]) -> None:
    root, ref = saved
    state = get_fp32_state_dict_from_zero_checkpoint(str(root), tag="lora")
    for n, v in ref["at_save"].items():
        assert torch.equal(state[n].float(), v), n


def _write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    write_safetensors(path, specs, lambda spec: tensors[spec.name], metadata, checksums=True)


def _as_version_1(src: Path, dst: Path) -> None:
    """Rewrite a checkpoint as version 1 wrote it: frozen parameters whole in the extra file."""
    dst.mkdir()
    meta = json.loads((src / "zeroshard.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(src / "extra.safetensors"), "pt") as f:
        tensors.update({k: f.get_tensor(k) for k in f.keys()})
    for p in meta.pop("frozen_params"):
        parts = []
        for piece in p["pieces"]:
            with safe_open(str(src / piece["file"]), "pt") as f:
                parts.append(f.get_tensor(f"frozen/{p['name']}"))
        tensors[f"frozen/{p['name']}"] = torch.cat(parts).view(p["shape"])
        meta["frozen"].append(p["name"])
    _write(dst / "extra.safetensors", tensors, {"format": "zeroshard"})
    for rank in range(meta["world_size"]):
        name = f"rank-{rank:05d}-of-{meta['world_size']:05d}.safetensors"
        with safe_open(str(src / name), "pt") as f:
            kept = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("frozen/")}
            file_meta = {k: v for k, v in f.metadata().items() if not k.startswith(CRC_KEY)}
        _write(dst / name, kept, file_meta)
    meta["version"] = 1
    meta["files"] = {name: (dst / name).stat().st_size for name in meta["files"]}
    raw = json.dumps(meta, indent=1).encode()
    (dst / "zeroshard.json").write_bytes(raw)
    (dst / "COMPLETE").write_text(marker_text(raw))


def load_v1_worker(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    engine = _engine(3, world)
    engine.load_checkpoint(root, tag="v1")
    out = gathered_weights(engine)
    engine.destroy()
    return out


def test_version_1_checkpoints_still_load(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    root, ref = saved
    _as_version_1(root / "lora", tmp_path / "v1")
    loaded = run_distributed(load_v1_worker, 1, str(tmp_path))[0]
    for n, v in ref["at_save"].items():
        assert torch.equal(loaded[n], v), n
