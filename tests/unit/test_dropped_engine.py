"""An engine dropped without ``destroy()`` frees what it held (one process, a world of one).

transformers' Trainer, hyperparameter searches and notebooks build engine after engine in one
process and never call ``destroy()``. Each dropped engine stayed alive: the gradient hooks on the
parameters were bound methods, which Python's cycle collector does not see through, so every trial
kept its masters, optimizer state and gradient buffers (+192 MB per trial for a 50 MB model), and
with NVMe offload also its I/O threads, file descriptors and swap files until the process exited.
"""

from __future__ import annotations

import gc
import os
import threading
import weakref
from pathlib import Path

import pytest
import torch

import zeroshard


def _config(stage: int, nvme: Path | None) -> dict:
    zero: dict = {"stage": stage}
    if nvme is not None:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(nvme)}
        zero["offload_param"] = {"device": "nvme", "nvme_path": str(nvme)}
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "steps_per_print": 10**9}


def _train(model: torch.nn.Module, cfg: dict) -> tuple[weakref.ref, weakref.ref]:
    engine, optimizer, _, _ = zeroshard.initialize(model=model, config=cfg)
    for i in range(2):
        x = torch.randn(4, 24, generator=torch.Generator().manual_seed(i))
        engine.backward(engine(x).square().mean())
        engine.step()
    return weakref.ref(engine), weakref.ref(optimizer)


def _aio_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("zeroshard-aio")]


@pytest.mark.parametrize("stage,offload", [(1, False), (2, False), (3, False), (3, True)])
def test_a_dropped_engine_is_freed(stage: int, offload: bool, tmp_path: Path, process_group: None) -> None:
    nvme = tmp_path / "nvme" if offload else None
    if nvme is not None:
        nvme.mkdir()
    weights = []
    for _ in range(3):  # a sweep of trials, each building its model and dropping everything after
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
        refs = _train(model, _config(stage, nvme))
        if stage < 3:
            weights.append([p.detach().clone() for p in model.parameters()])
        model_ref = weakref.ref(model)
        del model
        gc.collect()
        assert [r() for r in refs] == [None, None], "the dropped engine or its optimizer is still alive"
        assert model_ref() is None
        assert _aio_threads() == []
        if nvme is not None:
            assert [str(p) for p in nvme.rglob("*") if p.is_file()] == []
    for w in weights[1:]:  # the trials trained alike: nothing of an earlier engine reached a later one
        assert all(torch.equal(a, b) for a, b in zip(w, weights[0]))


def test_a_kept_model_loses_the_dropped_engines_hooks(process_group: None) -> None:
    """Re-wrapping the same model (training in phases): the first engine's gradient hooks leave the
    parameters once it is gone, and the second engine trains as plain PyTorch continuing from the
    same weights with a fresh optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
    _train(model, _config(2, None))
    ref = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)  # DeepSpeed's AdamW default
    _train(model, _config(2, None))
    for i in range(2):
        ref_opt.zero_grad()
        ref(torch.randn(4, 24, generator=torch.Generator().manual_seed(i))).square().mean().backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    gc.collect()  # the parameters name their engine's optimizer (GatheredParameters finds it so): the
    # second engine keeps its own hooks alive, the first one's are gone with it
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in model.parameters())  # type: ignore[attr-defined]


def test_a_forked_child_leaves_the_parents_swap_files(tmp_path: Path, process_group: None) -> None:
    """A child forked from a training process (a data-loader worker, a subprocess launcher) inherits
    the engine, not its I/O threads or files: collecting it there must not delete the parent's files."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
    engine, optimizer, _, _ = zeroshard.initialize(model=model, config=_config(3, nvme))
    engine.backward(engine(torch.randn(4, 24)).square().mean())
    engine.step()
    before = sorted(str(p) for p in nvme.rglob("*.swp"))
    assert before
    pid = os.fork()
    if pid == 0:  # the child drops everything and collects, as a worker ending would
        try:
            del engine, optimizer, model
            gc.collect()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert sorted(str(p) for p in nvme.rglob("*.swp")) == before
    engine.backward(engine(torch.randn(4, 24)).square().mean())
    engine.step()
    engine.destroy()
    assert list(nvme.rglob("*.swp")) == []
