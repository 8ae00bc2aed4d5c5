"""Partial optimizer offload (``offload_optimizer.ratio``, DeepSpeed's ZeRO-Offload++ "Twin-Flow") on 2 gloo ranks.

``ratio`` is the fraction of the optimizer's sub-groups *offloaded*, as in DeepSpeed 0.19.8: the
first ``int((1 - ratio) * sub-groups)`` keep their fp32 masters and optimizer state on the training
device, the rest are in host memory, and each sub-group steps where its state is. ZeRO-3 only, with
``device: cpu`` (``tests/unit/test_partial_offload_split.py`` has the refusals and the split rule).

A model of six linear layers whose sizes no world size divides, ``sub_group_size`` small enough that
each layer (a ZeRO-3 unit) is a sub-group of its own: six sub-groups a rank, three kept at ratio
0.5. Ten optimizer steps with gradient accumulation 2 and clipping 1.0:

- ratio 0.5 reaches *bit-identical* parameters to the in-memory run of ZeRO-3 (``torch.equal``;
  ``G = ||w - w_ref|| / ||w_ref||`` over all parameters is printed and held to 0), in fp32 and bf16,
  as do ratio 0.0 (everything kept) and ratio 1.0 (everything offloaded, which is the plain
  ``device: cpu`` run: same store, same ``memory_placement()``), and ratio 0.5 with the parameter
  shard in host memory or a swap file (``offload_param``);
- ``memory_placement()`` puts the masters and optimizer state of the kept sub-groups under ``device``
  and the others under ``host``, each equal to the sum over the sub-groups assigned there (masters:
  the sub-groups' padded rows in fp32; AdamW: ``exp_avg``, ``exp_avg_sq`` and a 4-byte ``step`` per
  master). On this CPU machine the training device *is* host memory, so this is the split as decided
  (the store's residencies, and the master buffer's two parts), not two memories;
- a checkpoint saved with ratio 0.5 resumes at the same world size into ratio 0.5, ratio 1.0 and no
  offload, each bit-identical to the unbroken run after more steps, and at 1 rank within 1e-6 (each
  rank's micro-batch mean then covers other samples, which rounds differently); a checkpoint saved
  without offload resumes into ratio 0.5 bit-identically;
- ``offload_states()`` / ``reload_states()`` (all five of DeepSpeed's names through the optimizer, as
  OpenRLHF calls it, and the engine's, which leaves the optimizer state and masters alone with
  ``offload_optimizer`` on) move both parts of the split master buffer, leave no old storage alive,
  and training after them stays bit-identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import zeroshard
from zeroshard.core.offload.policy import Residency
from zeroshard.core.offload.state_store import SplitStateStore, StateStore
from zeroshard.core.state_moves import StateKind
from zeroshard.deepspeed.utils import safe_get_full_fp32_param

#: six linear layers: 696, 930, 864, 812, 750 and 130 elements (odd weights: padded at 2 ranks)
DIMS = (23, 29, 31, 27, 29, 25, 5)
STEPS, GA, MB, LR, CLIP = 10, 2, 3, 1e-2, 1.0
#: resume: K steps, save, J more
K, J = 4, 3
#: per-rank rows of 349 to 466 elements, and 66 for the last layer: one sub-group per layer
SUB_GROUP = 300
KEY = "zero_optimization.offload_optimizer.ratio"


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(DIMS, DIMS[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def _model(seed: int = 0) -> Chain:
    torch.manual_seed(seed)
    return Chain()


def _data(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    n = steps * GA * MB * 2
    return torch.randn(n, DIMS[0], generator=g), torch.randn(n, DIMS[-1], generator=g)


def config(dtype: str = "fp32", device: str = "none", ratio: float | None = None, params: str = "none",
           nvme: str | None = None) -> dict[str, Any]:
    z: dict[str, Any] = {"stage": 3, "sub_group_size": SUB_GROUP, "reduce_bucket_size": 800,
                         "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 1500,
                         "stage3_prefetch_bucket_size": 900}
    if device != "none":
        z["offload_optimizer"] = {"device": device}
        if ratio is not None:
            z["offload_optimizer"]["ratio"] = ratio
    if params != "none":
        z["offload_param"] = {"device": params, "nvme_path": nvme, "buffer_count": 2, "buffer_size": 5000}
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GA,
                           "gradient_clipping": CLIP, "zero_optimization": z,
                           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def train(engine: Any, steps: range, rank: int, world: int) -> None:
    """Each step's global batch of ``GA * 2 * MB`` samples, split by micro-step, then by rank."""
    x, y = _data(STEPS)
    mb = 2 * MB // world
    for step in steps:
        for m in range(GA):
            i = (step * GA + m) * 2 * MB + rank * mb
            out = engine(x[i : i + mb])
            engine.backward(F.mse_loss(out.float(), y[i : i + mb]))
            engine.step()


def weights(engine: Any) -> list[torch.Tensor]:
    return [safe_get_full_fp32_param(p).detach().clone() for p in engine.module.parameters()]


def split_facts(engine: Any) -> dict[str, Any]:
    """The store's split decision and the bytes expected at each place, from the sub-groups' geometry."""
    store = engine.optimizer.store
    out: dict[str, Any] = {"store": type(store).__name__, "subgroups": len(store.subgroups)}
    if not isinstance(store, SplitStateStore):
        return out
    expected: dict[str, dict[str, int]] = {"master_weights": {}, "optimizer_states": {}}
    for sg, res in zip(store.subgroups, store.residencies):
        place = "device" if res is Residency.DEVICE else "host"
        expected["master_weights"][place] = expected["master_weights"].get(place, 0) + 4 * sg.numel
        # AdamW: exp_avg and exp_avg_sq of the real elements, and a float32 step, per master
        states = sum(8 * n + 4 for _view, _b, _off, n in sg.slices)
        expected["optimizer_states"][place] = expected["optimizer_states"].get(place, 0) + states
    master = engine.optimizer.master
    kept = [sg for sg, r in zip(store.subgroups, store.residencies) if r is Residency.DEVICE]
    device_part = master.segments[0].untyped_storage().data_ptr()
    out.update(
        residencies=[r.value for r in store.residencies],
        expected=expected,
        # the master buffer's device part ends where the first offloaded sub-group starts
        split_at=master.kept.end, kept_end=kept[-1].end if kept else 0,
        # every kept sub-group's masters are views of the device part, the others are not
        views_in_parts=all((view.untyped_storage().data_ptr() == device_part) == (r is Residency.DEVICE)
                           for sg, r in zip(store.subgroups, store.residencies) for view, *_ in sg.slices),
    )
    return out


def run(cfg: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    engine, *_ = zeroshard.initialize(model=_model(), config=cfg)
    train(engine, range(STEPS), rank, world)
    out = {"w": weights(engine), "placement": engine.optimizer.memory_placement(),
           "breakdown": engine.optimizer.memory_breakdown(), **split_facts(engine)}
    engine.destroy()
    return out


#: name -> (dtype, offload_optimizer.device, ratio[, offload_param.device])
RUNS: dict[str, tuple[Any, ...]] = {
    "fp32 in memory": ("fp32", "none", None),
    "fp32 ratio 0.5": ("fp32", "cpu", 0.5),
    "fp32 ratio 0.0": ("fp32", "cpu", 0.0),
    "fp32 ratio 1.0": ("fp32", "cpu", 1.0),
    "fp32 cpu": ("fp32", "cpu", None),
    "fp32 ratio 0.5, params cpu": ("fp32", "cpu", 0.5, "cpu"),
    "fp32 ratio 0.5, params nvme": ("fp32", "cpu", 0.5, "nvme"),
    "bf16 in memory": ("bf16", "none", None),
    "bf16 ratio 0.5": ("bf16", "cpu", 0.5),
    "bf16 ratio 0.5, params cpu": ("bf16", "cpu", 0.5, "cpu"),
}


def _storages(engine: Any) -> list[StorageWeakRef]:
    mover = engine.optimizer.state_mover
    return [StorageWeakRef(t.untyped_storage()) for k in StateKind for t in mover.tensors(k)
            if t.untyped_storage().nbytes() > 0]


def offload_states_run(rank: int, world: int) -> dict[str, Any]:
    """Ratio 0.5, with every state offloaded and reloaded after some backwards."""
    engine, *_ = zeroshard.initialize(model=_model(), config=config("fp32", "cpu", 0.5))
    x, y = _data(STEPS)
    mb = 2 * MB // world
    out: dict[str, Any] = {"left_behind": 0, "moved_masters": []}
    for step in range(STEPS):
        for m in range(GA):
            i = (step * GA + m) * 2 * MB + rank * mb
            engine.backward(F.mse_loss(engine(x[i : i + mb]).float(), y[i : i + mb]))
            if step % 3 == 1:
                before = _storages(engine)
                segments = [StorageWeakRef(s.untyped_storage()) for s in engine.optimizer.master.segments]
                if m == 0:  # as OpenRLHF: the optimizer's method, every name
                    engine.optimizer.offload_states(include=None)
                    out["moved_masters"].append(sum(not r.expired() for r in segments))
                else:  # the engine's: optim_states, hp_params and lp_grads left out (offload_optimizer is on)
                    engine.offload_states()
                engine.reload_states()
                if m == 0:
                    out["left_behind"] += sum(not r.expired() for r in before)
            engine.step()
    out["w"] = weights(engine)
    engine.destroy()
    return out


def job(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {name: run(config(*spec, nvme=f"{root}/nvme"), rank, world) for name, spec in RUNS.items()}
    out["initial"] = [p.detach().clone() for p in _model().parameters()]
    # Checkpoints: ratio 0.5 and in-memory sources, K steps, saved, J more (the unbroken runs).
    for name, spec in (("ratio", ("fp32", "cpu", 0.5)), ("memory", ("fp32", "none", None))):
        engine, *_ = zeroshard.initialize(model=_model(), config=config(*spec))
        train(engine, range(K), rank, world)
        engine.save_checkpoint(f"{root}/{name}")
        train(engine, range(K, K + J), rank, world)
        out[f"unbroken/{name}"] = weights(engine)
        engine.destroy()
    targets = {"ratio 0.5": ("fp32", "cpu", 0.5), "ratio 1.0": ("fp32", "cpu", 1.0),
               "in memory": ("fp32", "none", None)}
    for target, spec in targets.items():
        out[f"resume/ratio->{target}"] = resume(f"{root}/ratio", config(*spec), rank, world)
    out["resume/memory->ratio 0.5"] = resume(f"{root}/memory", config("fp32", "cpu", 0.5), rank, world)
    out["offload_states"] = offload_states_run(rank, world)
    return out


def resume(path: str, cfg: dict[str, Any], rank: int, world: int) -> list[torch.Tensor]:
    engine, *_ = zeroshard.initialize(model=_model(5), config=cfg)  # other initial weights: all must load
    engine.load_checkpoint(path)
    train(engine, range(K, K + J), rank, world)
    w = weights(engine)
    engine.destroy()
    return w


def job_one_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    return {"resume/2->1 ratio 0.5": resume(f"{root}/ratio", config("fp32", "cpu", 0.5), rank, world),
            "split": split_facts(zeroshard.initialize(model=_model(), config=config("fp32", "cpu", 0.5))[0])}


def distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """G = ||w - w_ref|| / ||w_ref|| over all parameters together."""
    wa, wb = torch.cat([t.reshape(-1) for t in a]), torch.cat([t.reshape(-1) for t in b])
    return float((wa - wb).norm() / wb.norm())


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("partial_offload"))
    Path(root, "nvme").mkdir()
    two = run_distributed(job, 2, root, timeout=600)
    one = run_distributed(job_one_rank, 1, root, timeout=300)[0]
    return two, one


def test_ratio_half_is_bit_identical_to_in_memory(results: tuple[list[dict[str, Any]], dict[str, Any]]) -> None:
    two, _ = results
    for rank, r in enumerate(two):
        assert distance(r["fp32 in memory"]["w"], r["initial"]) > 1e-2  # it trained
        for dtype in ("fp32", "bf16"):
            ref = r[f"{dtype} in memory"]["w"]
            names = [n for n in RUNS if n.startswith(dtype) and n != f"{dtype} in memory"]
            for name in names:
                g = distance(r[name]["w"], ref)
                print(f"rank {rank}: {name} vs {dtype} in memory: G = {g:.3e}")
                assert same(r[name]["w"], ref), f"rank {rank}: {name}: not bit-identical to in memory (G {g:.2e})"
                assert g == 0.0
        for name in RUNS:
            if "ratio 0.5" in name:
                assert r[name]["store"] == SplitStateStore.__name__ and r[name]["subgroups"] == 6, name
                assert r[name]["residencies"] == ["device"] * 3 + ["host"] * 3, name
        assert r["fp32 ratio 0.5, params nvme"]["placement"]["parameter_shard"].get("file", 0) > 0


def test_memory_placement_shows_the_split(results: tuple[list[dict[str, Any]], dict[str, Any]]) -> None:
    two, one = results
    for rank, r in enumerate(two):
        half = r["fp32 ratio 0.5"]
        # DeepSpeed's rule: the first int((1 - 0.5) * 6) = 3 sub-groups stay on the device
        assert half["residencies"] == ["device"] * 3 + ["host"] * 3, half["residencies"]
        assert half["split_at"] == half["kept_end"] > 0 and half["views_in_parts"], half
        placement = half["placement"]
        for kind in ("master_weights", "optimizer_states"):
            assert placement[kind] == half["expected"][kind], (rank, kind, placement[kind], half["expected"][kind])
            assert placement[kind]["device"] > 0 and placement[kind]["host"] > 0
        # about half of the state each side (the layers differ in size: 2 / 3 of the bytes are kept)
        kept = placement["optimizer_states"]["device"] / sum(placement["optimizer_states"].values())
        assert 0.4 < kept < 0.7, kept
        # memory_breakdown() counts both places
        assert half["breakdown"]["optimizer_states"] == sum(placement["optimizer_states"].values())
        assert half["breakdown"]["master_weights"] == sum(placement["master_weights"].values())
        # the parameter shard is a copy of its own (as on an accelerator), the gradients in host memory
        assert placement["parameter_shard"] == {"host": sum(placement["master_weights"].values())}
        assert set(placement["gradients"]) == {"host"}
        everything = r["fp32 ratio 0.0"]
        assert everything["residencies"] == ["device"] * 6
        assert set(everything["placement"]["master_weights"]) == set(everything["placement"]["optimizer_states"]) \
            == {"device"}
        # ratio 1.0 is the plain CPU offload: the same store, the same report
        assert r["fp32 ratio 1.0"]["store"] == r["fp32 cpu"]["store"] == StateStore.__name__
        assert r["fp32 ratio 1.0"]["placement"] == r["fp32 cpu"]["placement"]
        assert "device" not in r["fp32 ratio 1.0"]["placement"]["optimizer_states"]
    # one rank: the shard is the whole model, the same six sub-groups (each layer alone)
    assert one["split"]["residencies"] == ["device"] * 3 + ["host"] * 3


def test_checkpoint_with_ratio_resumes(results: tuple[list[dict[str, Any]], dict[str, Any]]) -> None:
    two, one = results
    for rank, r in enumerate(two):
        unbroken = r["unbroken/ratio"]
        assert same(unbroken, r["unbroken/memory"]), rank  # the premise: ratio 0.5 is the in-memory run
        for target in ("ratio 0.5", "ratio 1.0", "in memory"):
            got = r[f"resume/ratio->{target}"]
            assert same(got, unbroken), f"rank {rank}: ratio 0.5 -> {target}: G {distance(got, unbroken):.2e}"
        got = r["resume/memory->ratio 0.5"]
        assert same(got, r["unbroken/memory"]), f"rank {rank}: in memory -> ratio 0.5: G {distance(got, unbroken):.2e}"
    g = distance(one["resume/2->1 ratio 0.5"], two[0]["unbroken/ratio"])
    print(f"ratio 0.5 saved at 2 ranks, resumed at 1: G = {g:.3e}")
    assert g <= 1e-6


def test_offload_states_with_ratio(results: tuple[list[dict[str, Any]], dict[str, Any]]) -> None:
    two, _ = results
    for rank, r in enumerate(two):
        seen = r["offload_states"]
        assert seen["left_behind"] == 0, (rank, seen)
        assert seen["moved_masters"] and all(n == 0 for n in seen["moved_masters"]), (rank, seen["moved_masters"])
        assert same(seen["w"], r["fp32 in memory"]["w"]), rank
