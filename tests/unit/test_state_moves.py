"""Moving training state to host memory and back (``zeroshard.core.state_moves``), one process.

What can honestly be checked without an accelerator: on the CPU the training device *is* the host,
so "offloaded" tensors stay CPU tensors. What the move does is still observable: every storage is
replaced by a new one (another data pointer), every tensor on it is re-pointed at the same offset,
sizes and strides (aliases stay aliases: a write through one is seen through the others), values
are bit-identical, and the old storage is freed once no tensor points at it (a
``StorageWeakRef`` expires): on an accelerator that is the device memory handed back. A tensor left
out of a move keeps its old storage alive, which is why the stage lists every view it holds
(``tests/distributed/test_offload_states.py`` checks that on real engines). Refusals of the engine
methods (DeepSpeed's) are checked here on one-rank engines.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import zeroshard
from zeroshard.core.state_moves import StateKind, StateMover, relocate
from zeroshard.deepspeed.misc import OffloadDeviceEnum
from zeroshard.deepspeed.offload_states import OffloadStatesError, OffloadStateTypeEnum, get_state_devices
from zeroshard.errors import ConfigError

CPU = torch.device("cpu")


def _aliases() -> tuple[torch.Tensor, list[torch.Tensor]]:
    flat = torch.arange(64, dtype=torch.float32)
    views = [
        flat[3:11],                                  # a slice
        torch.nn.Parameter(flat[11:23].view(3, 4)),  # a parameter viewing it (the masters)
        flat[24:48].view(4, 6).t(),                  # strided (a weight.t() autograd saved)
        flat[48:56].view(torch.int32),               # another dtype on the same bytes
        flat.narrow(0, 56, 8),                       # DeepSpeed's ds_tensor is such a narrow
    ]
    return flat, views


def test_relocate_copies_each_storage_once_and_repoints_every_alias() -> None:
    flat, views = _aliases()
    lone = torch.randn(5)
    expected = [t.clone() for t in [flat, *views, lone]]
    shapes = [(t.shape, t.stride(), t.storage_offset(), t.dtype) for t in [flat, *views, lone]]
    param = views[1]
    old = [StorageWeakRef(flat.untyped_storage()), StorageWeakRef(lone.untyped_storage())]
    old_ptrs = {flat.untyped_storage().data_ptr(), lone.untyped_storage().data_ptr()}

    moved = relocate([flat, *views, lone, flat], CPU)  # a repeat is moved once

    assert len(moved) == 2
    gc.collect()
    assert all(r.expired() for r in old), "the old storages must be freed: nothing points at them any more"
    assert {flat.untyped_storage().data_ptr(), lone.untyped_storage().data_ptr()}.isdisjoint(old_ptrs)
    for t, e, s in zip([flat, *views, lone], expected, shapes):
        assert (t.shape, t.stride(), t.storage_offset(), t.dtype) == s
        assert torch.equal(t, e)  # bit-identical (int32 and strided views included)
        assert t.device == CPU and not t.is_pinned()
    assert all(v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for v in views)
    assert isinstance(param, torch.nn.Parameter) and param.requires_grad
    with torch.no_grad():
        flat[11] = -1.0  # one storage still: a write shows through every view of it
        views[0][0] = -2.0
    assert param[0, 0] == -1.0 and flat[3] == -2.0


def test_a_tensor_left_out_keeps_the_old_storage() -> None:
    """Why a stage lists every view it holds: one left behind keeps the memory and stops aliasing."""
    flat, views = _aliases()
    ref = StorageWeakRef(flat.untyped_storage())
    relocate([flat, *views[:-1]], CPU)
    gc.collect()
    assert not ref.expired()
    with torch.no_grad():
        flat[56] = 123.0
    assert views[-1][0] != 123.0


def test_relocate_leaves_empty_storages_and_uses_the_allocator_given() -> None:
    empty = torch.zeros(0)
    ptr = empty.untyped_storage().data_ptr()
    made: list[int] = []

    def allocate(t: torch.Tensor) -> Any:
        def own(nbytes: int) -> torch.Tensor:
            made.append(nbytes)
            return torch.zeros(nbytes + 16, dtype=torch.uint8)  # larger than needed is fine

        return own

    t = torch.arange(6, dtype=torch.float64)
    relocate([empty, t], CPU, allocate=allocate, non_blocking=True)
    assert made == [48] and torch.equal(t, torch.arange(6, dtype=torch.float64))
    assert empty.untyped_storage().data_ptr() == ptr


# -- on one-rank engines ----------------------------------------------------------------------------

def _engine(stage: int, bf16: bool = False, **zero: Any) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": bf16},
                           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _train_step(engine: Any) -> None:
    engine.backward(engine(torch.ones(2, 6)).pow(2).mean())
    engine.step()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_what_stays_off_the_training_device_is_not_moved(stage: int, process_group: None) -> None:
    """State the config already keeps in host memory stays where it is: seen from a (pretended)
    accelerator, every CPU tensor is off the device, and nothing moves."""
    engine = _engine(stage)
    _train_step(engine)
    mover = StateMover(engine.optimizer)
    mover.device = torch.device("cuda", 0)  # nothing here is on it
    before = {id(t): t.untyped_storage().data_ptr() for k in StateKind for t in mover.tensors(k)}
    assert mover.offload(list(StateKind)) == 0
    assert {id(t): t.untyped_storage().data_ptr() for k in StateKind for t in mover.tensors(k)} == before
    engine.destroy()


def test_refusals_and_no_ops(process_group: None, caplog: pytest.LogCaptureFixture) -> None:
    e0 = _engine(0)
    with pytest.raises(ConfigError, match="stage 1, 2 or 3") as info:
        e0.offload_states()
    assert info.value.key == "zero_optimization.stage"
    with pytest.raises(ConfigError, match="stage 1, 2 or 3"):
        e0.reload_states()
    e0.destroy()

    e = _engine(2)
    with pytest.raises(ValueError, match="unknown state 'optim_state'.*optim_states, hp_params"):
        e.offload_states(include=["optim_state"])
    with pytest.raises(ValueError, match="NVMe offload is not supported for offloading states"):
        e.offload_states(device=OffloadDeviceEnum.nvme)
    with pytest.raises(ValueError, match="expected OffloadDeviceEnum.cpu"):
        e.offload_states(device="gpu")
    with caplog.at_level(logging.WARNING, logger="zeroshard"):
        e.offload_states(device=OffloadDeviceEnum.none)
    assert "No device specified for offloading states." in caplog.text
    assert e.optimizer.offloaded_states == set()
    e.reload_states()  # nothing offloaded: nothing to do
    _train_step(e)
    e.offload_states(include=[OffloadStateTypeEnum.optim_states], device="cpu")
    assert e.optimizer.offloaded_states == {OffloadStateTypeEnum.optim_states}
    with pytest.raises(RuntimeError, match=r"engine.step\(\).*\(optim_states\): call engine.reload_states\(\) first"):
        e.step()
    with pytest.raises(RuntimeError, match=r"optimizer step.*\(optim_states\)"):
        e.optimizer.step()  # the optimizer's own, called directly
    assert e.global_steps == 1 and e.window.position == 0  # nothing was counted
    e.backward(e(torch.ones(2, 6)).sum())  # gradients are not offloaded: backward may run
    e.offload_states(include="lp_grads")  # one name alone; optim_states stays offloaded
    assert e.optimizer.offloaded_states == {OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.lp_grads}
    with pytest.raises(RuntimeError, match=r"engine.backward\(\).*lp_grads"):
        e.backward(e(torch.ones(2, 6)).sum())
    e.offload_states(include=["lp_params"])
    with pytest.raises(RuntimeError, match=r"forward.*lp_params"):
        e(torch.ones(2, 6))
    assert get_state_devices(e, OffloadStateTypeEnum.contiguous_grad_buffer) == set()
    e.reload_states()
    assert e.optimizer.offloaded_states == set()
    e.step()
    e.destroy()

    evaluation = zeroshard.initialize(model=torch.nn.Linear(3, 3),
                                      config={"train_micro_batch_size_per_gpu": 1,
                                              "zero_optimization": {"stage": 3}})[0]
    with pytest.raises(OffloadStatesError, match="without an optimizer") as err:
        evaluation.offload_states()
    assert isinstance(err.value, AssertionError) and err.value.key == "optimizer"
    with pytest.raises(AssertionError, match="without an optimizer"):
        evaluation.reload_states()
    evaluation.destroy()

    params = _engine(3, offload_param={"device": "cpu"})
    with pytest.raises(OffloadStatesError, match="not supported for offloaded parameters") as err:
        params.offload_states()
    assert err.value.key == "zero_optimization.offload_param.device"
    params.destroy()


@pytest.mark.parametrize("stage", [1, 3])
def test_optimizer_offload_leaves_out_what_the_config_offloads(stage: int, process_group: None) -> None:
    """As DeepSpeed: with ``offload_optimizer`` on, the engine leaves ``hp_params`` and ``optim_states``
    out (at ZeRO-3 ``lp_grads`` too); the optimizer's own method (OpenRLHF calls it) does not. (At
    ZeRO-3 the parameter shard is the masters: ``lp_params`` takes them along.)"""
    e = _engine(stage, bf16=True, offload_optimizer={"device": "cpu"})
    _train_step(e)
    e.offload_states()
    left = {OffloadStateTypeEnum.optim_states} | (
        {OffloadStateTypeEnum.lp_grads} if stage == 3 else {OffloadStateTypeEnum.hp_params})
    assert not left & e.optimizer.offloaded_states
    assert OffloadStateTypeEnum.lp_params in e.optimizer.offloaded_states
    e.reload_states()
    e.optimizer.offload_states(include=[OffloadStateTypeEnum.optim_states])
    assert e.optimizer.offloaded_states == {OffloadStateTypeEnum.optim_states}
    e.optimizer.reload_states()
    _train_step(e)
    e.destroy()
