"""``zero.Init(remote_device="nvme")`` with the config's ``offload_param.nvme_path``: the chunks go
to file-backed buffers there as they are made, and leave the process.

On 2 gloo ranks a 29M-parameter MLP (28 layers of 1024 x 1024, fp32: each rank's chunks are
58.8 MB) is built under the block, then trained 2 steps at stage 3 with parameters and optimizer
on NVMe. Measured per rank, against a baseline taken just before the build (after the same code
paths ran on a tiny model):

* the peak RSS growth while building is at least half the chunks' bytes below the same build
  with ``remote_device="cpu"`` (which keeps them in host memory: all of them, checked), and what
  the block leaves in the process is under an eighth of them;
* ``initialize`` copies the chunks into the swap files without bringing them back: its peak
  (from the same baseline) is at least half the chunks' bytes below the ``"cpu"`` run's (the
  masters' and the shard's initial writes read one chunk at a time and let it go). Measured:
  build peak 12 MiB (kept 1) against 60 (kept 56), initialize peak 30-32 MiB against 82-84, and
  the same training peak afterwards (120-124 MiB: activations, gathered units, swap buffers);
* training is bit-identical to the same run built with ``remote_device="cpu"``.
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

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")

WIDTH, LAYERS, MICRO, WORLD = 1024, 28, 4, 2


def _config(nvme: str) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_max_live_parameters": 2 * WIDTH * (WIDTH + 1),
                                  "stage3_prefetch_bucket_size": WIDTH * (WIDTH + 1), "sub_group_size": 2_000_000,
                                  "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 2},
                                  "offload_param": {"device": "nvme", "nvme_path": nvme, "buffer_count": 4,
                                                    "buffer_size": 2 * WIDTH * (WIDTH + 1)}},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _build(remote: str, nvme: str, width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    with zeroshard.zero.Init(remote_device=remote, config_dict_or_path=_config(nvme)):
        return nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())))


def _train(model: nn.Module, nvme: str, rank: int, width: int, initialized: Any = None) -> Any:
    engine = initialized or zeroshard.initialize(model=model, config=_config(nvme))[0]
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        engine.backward(engine(torch.randn(MICRO, width, generator=g)).square().mean())
        engine.step()
    return engine


def worker(rank: int, world: int, remote: str, nvme: str) -> dict[str, Any]:
    os.environ["ZEROSHARD_MALLOC_TRIM"] = "1"
    _train(_build(remote, nvme, 64, 2), nvme, rank, 64).destroy()  # warm-up: the same code paths
    base = rss.reset_peak()
    model = _build(remote, nvme, WIDTH, LAYERS)
    built = rss.status()
    rss.reset_peak()
    engine, *_ = zeroshard.initialize(model=model, config=_config(nvme))
    initialized = rss.status()
    _train(model, nvme, rank, WIDTH, engine)
    with engine.gathered():
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"build_peak": built["VmHWM"] - base["VmRSS"], "after_build": built["VmRSS"] - base["VmRSS"],
            "init_peak": initialized["VmHWM"] - base["VmRSS"], "params": params}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    nvme = str(tmp_path_factory.mktemp("nvme"))
    return {remote: run_distributed(worker, WORLD, remote, nvme, timeout=600) for remote in ("nvme", "cpu")}


def test_chunks_leave_the_process_while_building(runs: dict[str, list[dict[str, Any]]]) -> None:
    chunk_bytes = LAYERS * WIDTH * (WIDTH + 1) * 4 // WORLD
    for rank, (nv, cpu) in enumerate(zip(runs["nvme"], runs["cpu"])):
        print(f"rank {rank}: build peak growth nvme {nv['build_peak'] / 2**20:.0f} MiB (kept "
              f"{nv['after_build'] / 2**20:.0f}), cpu {cpu['build_peak'] / 2**20:.0f} MiB (kept "
              f"{cpu['after_build'] / 2**20:.0f}); initialize peak nvme {nv['init_peak'] / 2**20:.0f}, "
              f"cpu {cpu['init_peak'] / 2**20:.0f} MiB; chunks {chunk_bytes / 2**20:.0f} MiB")
        assert cpu["after_build"] >= chunk_bytes, cpu  # the comparison holds its chunks
        # the build's own transients (a full parameter at a time, broadcasts) remain, the chunks do not
        assert nv["build_peak"] < cpu["build_peak"] - chunk_bytes / 2 and nv["after_build"] < chunk_bytes / 8, nv
        assert nv["init_peak"] < cpu["init_peak"] - chunk_bytes / 2, (nv["init_peak"], cpu["init_peak"])


def test_training_is_the_same(runs: dict[str, list[dict[str, Any]]]) -> None:
    for nv, cpu in zip(runs["nvme"], runs["cpu"]):
        assert nv["params"].keys() == cpu["params"].keys()
        assert all(torch.equal(nv["params"][n], cpu["params"][n]) for n in nv["params"])
