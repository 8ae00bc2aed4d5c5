"""NVMe offload shows in the process's real memory: the optimizer state leaves RSS for files.

A 29M-parameter MLP (28 layers of 1024 x 1024) trains in bf16 with AdamW, so its fp32 state,
masters (4Ψ bytes) and ``exp_avg``/``exp_avg_sq`` (8Ψ: 224 MiB), is several times the rest of the
process (2Ψ of bf16 parameters, 4Ψ of fp32 gradients, small activations: micro batch 8). It trains
3 steps on one rank in four fresh spawned processes: stage 2 in memory and with
``offload_optimizer: nvme``, stage 3 in memory and with optimizer state and parameters on NVMe.
Each figure is the growth of the process's peak RSS (VmHWM, reset through
``/proc/self/clear_refs``) over a baseline taken after imports and a tiny warm-up run through the
same code paths (code pages, gloo buffers), just before the model is built.
``sub_group_size`` 1e6 and 2 buffers keep the swap buffers to two sub-groups of one layer each.

Must show, per stage: the NVMe run's peak growth is below the in-memory run's minus half the
bytes it keeps out of memory: the optimizer state (``exp_avg`` and ``exp_avg_sq``, 8Ψ) in swap
files and the fp32 gradient shard (4Ψ) in a file-backed buffer whose pages are dropped once used
(measured after that change: 174 / 150 MiB at stages 2 / 3 against 513 / 464 in memory). Measured on an idle
machine: in memory 513 / 480-488 MiB, NVMe 250-251 / 157-162 MiB at stages 2 / 3, so the bound
(minus 112 MiB) holds by at least 150 MiB. (Until the first step returned the heap pages of the
state the optimizer creates per sub-group, stage 3's NVMe peak was 263-355 MiB, in that first
step, and this test failed now and then.) In fp32 the same model's backward and
first-step transients (glibc retention of freed gradient and temporary buffers) moved the peaks by
up to 90 MiB from run to run against a 4Ψ margin, too close to call, hence bf16.

And the accounting agrees with the files: ``memory_placement()`` puts the optimizer state under
``file`` with exactly the size of the swap files on disk (one aligned region per sub-group,
``Σ round_up(4 · numel, 4096)`` per state key, 2 keys for AdamW, and the same for ``master.swp``),
covering every element of the master layout, while ``memory_usage()["optimizer_states"]`` (bytes
in memory) stays a small part of the 8Ψ in the files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import rss
import torch
from harness import run_distributed
from torch import nn

import zeroshard
from zeroshard.core.host_memory import FileMappedBuffer
from zeroshard.deepspeed.utils import safe_get_full_fp32_param

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")

MiB = 2**20
WIDTH, LAYERS, MICRO, STEPS = 1024, 28, 8, 3
SUB_GROUP, BUFFERS = 1_000_000, 2


class Deep(nn.Module):
    """A stack of square linear layers: parameters, not activations, dominate memory."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


_status = rss.status
_baseline = rss.reset_peak


def _config(stage: int, nvme: str | None, defaults: bool = False) -> dict[str, Any]:
    z: dict[str, Any] = {"stage": stage, "reduce_bucket_size": SUB_GROUP, "allgather_bucket_size": SUB_GROUP,
                         "sub_group_size": SUB_GROUP, "stage3_param_persistence_threshold": 0,
                         "stage3_max_live_parameters": 3 * WIDTH * (WIDTH + 1),
                         "stage3_prefetch_bucket_size": WIDTH * (WIDTH + 1)}
    if defaults:  # as a user writes it: DeepSpeed's bucket sizes, sub_group_size and buffer_count left unset
        z = {"stage": stage}
    if nvme is not None:
        z["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
        if not defaults:
            z["offload_optimizer"]["buffer_count"] = BUFFERS
        if stage == 3:
            z["offload_param"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 4,
                                  "buffer_size": 2 * WIDTH * (WIDTH + 1)}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "gradient_clipping": 1.0, "zero_optimization": z,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


def _train(stage: int, nvme: str | None, width: int, layers: int, defaults: bool = False) -> tuple[Any, int]:
    torch.manual_seed(0)
    model = Deep(width, layers)
    psi = sum(p.numel() for p in model.parameters())
    engine, *_ = zeroshard.initialize(model=model, config=_config(stage, nvme, defaults))
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        engine.backward(engine(torch.randn(MICRO, width, generator=g)))
        engine.step()
    return engine, psi


def memory_worker(rank: int, world: int, stage: int, nvme: str | None, defaults: bool = False) -> dict[str, Any]:
    os.environ["ZEROSHARD_MALLOC_TRIM"] = "1"  # return freed heap pages, as in test_memory_rss.py
    _train(stage, nvme, 64, 2, defaults)[0].destroy()  # warm-up: the same code paths on a tiny model
    base = _baseline()
    engine, psi = _train(stage, nvme, WIDTH, LAYERS, defaults)
    now = _status()
    out: dict[str, Any] = {"peak": now["VmHWM"] - base["VmRSS"], "psi": psi,
                           "placement": engine.optimizer.memory_placement(), "usage": engine.memory_usage()}
    store = engine.optimizer.store
    if nvme is not None:
        out["files"] = {f.name: f.stat().st_size for f in store.directory.iterdir()}
        out["regions"] = [sg.numel for sg in store.subgroups]
        out["layout_numel"] = int(engine.optimizer.master.numel)
        out["keys"] = list(store.keys)
        out["slot_bytes"] = sum(s.nbytes for s in store.slots)
        # ZeRO-3 leaves the last step's sub-groups to the next forward: a reader of the masters ends it
        safe_get_full_fp32_param(next(engine.module.parameters()))
        out["discarded"] = engine.optimizer.sync.discarded_bytes
        out["slices"] = len(engine.optimizer.master.slices)
        if stage == 3:
            out["param_file"] = engine.optimizer.shard.swap.file.path.stat().st_size
    engine.destroy()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Four fresh processes, one rank each: the peaks are independent."""
    nvme = str(tmp_path_factory.mktemp("nvme"))
    out = {f"s{stage}/{kind}": run_distributed(memory_worker, 1, stage, nvme if kind == "nvme" else None,
                                               timeout=600)[0]
           for stage in (2, 3) for kind in ("mem", "nvme")}
    out["s2/nvme-defaults"] = run_distributed(memory_worker, 1, 2, nvme, True, timeout=600)[0]
    return out


def _round_up(n: int) -> int:
    return -(-n // 4096) * 4096


@pytest.mark.parametrize("stage", [2, 3])
def test_nvme_offload_lowers_peak_rss_by_the_optimizer_state(runs: dict[str, dict[str, Any]], stage: int) -> None:
    mem, nv = runs[f"s{stage}/mem"], runs[f"s{stage}/nvme"]
    psi = mem["psi"]
    assert psi == nv["psi"] == LAYERS * WIDTH * (WIDTH + 1)
    swapped = nv["placement"]["optimizer_states"]["file"]
    assert swapped >= 8 * psi  # AdamW's exp_avg and exp_avg_sq in fp32, all of it in the files
    # and the fp32 gradient shard: a file-backed buffer, its pages in the process only while used
    spilled = nv["placement"]["gradients"]["file"]
    assert spilled >= 4 * psi and nv["usage"]["gradients"] == 0, (nv["placement"]["gradients"], nv["usage"])
    swapped += spilled
    print(f"stage {stage}: peak RSS growth in memory {mem['peak'] / MiB:.0f} MiB, NVMe {nv['peak'] / MiB:.0f} MiB "
          f"(must be < {(mem['peak'] - 0.5 * swapped) / MiB:.0f}); optimizer state and gradients out of memory "
          f"{swapped / MiB:.0f} MiB")
    assert nv["peak"] < mem["peak"] - 0.5 * swapped, (
        f"stage {stage}: NVMe peak growth {nv['peak'] / MiB:.0f} MiB is not below the in-memory "
        f"{mem['peak'] / MiB:.0f} MiB minus half the {swapped / MiB:.0f} MiB swapped out")


@pytest.mark.parametrize("stage", [2, 3])
def test_placement_is_the_swap_files(runs: dict[str, dict[str, Any]], stage: int) -> None:
    """``file`` bytes are the files on disk: one aligned region per sub-group per state key."""
    nv = runs[f"s{stage}/nvme"]
    assert nv["keys"] == ["exp_avg", "exp_avg_sq"], nv["keys"]
    assert sum(nv["regions"]) == nv["layout_numel"] >= nv["psi"]
    assert max(nv["regions"]) <= max(SUB_GROUP, WIDTH * (WIDTH + 1)), nv["regions"]  # a layer, or a run of small ones
    region_bytes = sum(_round_up(4 * n) for n in nv["regions"])
    assert nv["files"]["exp_avg.swp"] == nv["files"]["exp_avg_sq.swp"] == region_bytes, (nv["files"], region_bytes)
    assert nv["placement"]["optimizer_states"]["file"] == 2 * region_bytes, nv["placement"]
    # bf16: the fp32 masters are not the module's parameters, so they are swapped too
    assert nv["files"]["master.swp"] == region_bytes == nv["placement"]["master_weights"]["file"], nv["placement"]
    assert set(nv["files"]) == {"master.swp", "exp_avg.swp", "exp_avg_sq.swp"}, nv["files"]
    # in memory: the sub-group buffers (counted: a duplicate "host" key once dropped them) and the
    # ``step`` scalars
    in_memory = nv["usage"]["optimizer_states"]
    assert nv["slot_bytes"] <= in_memory <= nv["slot_bytes"] + 8 * 2 * LAYERS, (in_memory, nv["slot_bytes"])
    assert in_memory < 0.25 * 8 * nv["psi"], f"{in_memory / MiB:.0f} MiB of optimizer state still in memory"
    assert runs[f"s{stage}/mem"]["usage"]["optimizer_states"] >= 8 * nv["psi"]
    if stage == 3:  # bf16 parameter shard: one aligned region per unit (a layer: 2 * 1024 * 1025 bytes)
        assert nv["placement"]["parameter_shard"]["file"] == nv["param_file"] == LAYERS * _round_up(
            2 * WIDTH * (WIDTH + 1)), (nv["placement"], nv["param_file"])
        # memory_usage() counts memory only: the shard's host buffers, not its swap file
        shard = nv["placement"]["parameter_shard"]
        assert nv["usage"]["parameter_shard"] == sum(v for k, v in shard.items() if k != "file"), (nv["usage"], shard)


def test_nvme_offload_with_deepspeeds_defaults_lowers_peak_rss(runs: dict[str, dict[str, Any]]) -> None:
    """Stage 2 with ``offload_optimizer: {device: nvme}`` and nothing else set, as users write it:
    with DeepSpeed's ``sub_group_size`` (1e9) one sub-group would hold the whole shard in host
    buffers and the peak would not move; left unset, zeroshard sizes the sub-groups so that the
    buffers hold at most a quarter of the state, and the same bound as above holds."""
    mem, nv = runs["s2/mem"], runs["s2/nvme-defaults"]
    swapped = nv["placement"]["optimizer_states"]["file"]
    assert swapped >= 8 * nv["psi"]
    assert len(nv["regions"]) >= 4, nv["regions"]  # sub-groups were chosen, not one of everything
    in_memory_state = mem["usage"]["optimizer_states"] + mem["usage"].get("master_weights", 0)
    assert nv["slot_bytes"] <= 0.25 * in_memory_state + 4 * max(nv["regions"]) * 3, (nv["slot_bytes"], in_memory_state)
    print(f"defaults: peak RSS growth in memory {mem['peak'] / MiB:.0f} MiB, NVMe {nv['peak'] / MiB:.0f} MiB, "
          f"swap buffers {nv['slot_bytes'] / MiB:.0f} MiB in {len(nv['regions'])} sub-groups")
    assert nv["peak"] < mem["peak"] - 0.5 * swapped, (
        f"NVMe peak growth {nv['peak'] / MiB:.0f} MiB with DeepSpeed's defaults is not below the in-memory "
        f"{mem['peak'] / MiB:.0f} MiB minus half the {swapped / MiB:.0f} MiB swapped out")


@pytest.mark.parametrize("stage", [2, 3])
def test_stepped_gradients_are_discarded_not_written_back(runs: dict[str, dict[str, Any]], stage: int,
                                                         tmp_path: Path) -> None:
    """Once a sub-group is stepped, its spilled fp32 gradients are removed from the file
    (``MADV_REMOVE``) rather than left dirty in the page cache for the kernel to write to the disk:
    every step, all of the 4Ψ bytes but the partial pages at each master's ends."""
    nv = runs[f"s{stage}/nvme"]
    if not _punches_holes(tmp_path):
        pytest.skip("the temporary directory's filesystem does not punch holes (MADV_REMOVE)")
    expected = STEPS * (4 * nv["psi"] - 2 * 4096 * nv["slices"])
    assert expected <= nv["discarded"] <= STEPS * 4 * nv["psi"], (nv["discarded"], expected)


def _punches_holes(directory: Path) -> bool:
    buf = FileMappedBuffer(directory, 2 * 4096)
    buf.tensor(torch.uint8).fill_(1)
    return buf.discard(0, 2 * 4096) > 0
