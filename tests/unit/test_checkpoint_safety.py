"""Safe loading: no pickle code ever runs. DeepSpeed-style ``.pt`` files carrying payloads are
refused with an error naming the file and the global, and the payload never executes; foreign
classes become inert records without their modules being imported; ``torch.load`` is never used."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import zeroshard
from zeroshard.checkpoint.unpickle import InertRecord, LazyTensor, RestrictedUnpickler, load_restricted
from zeroshard.cli.main import main as cli


class _Call:
    """Pickles as a call of ``fn(*args)``, as an attacker's object would."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _ds_dir(root: Path, payload: object) -> Path:
    """A DeepSpeed-looking checkpoint (``latest`` + tag directory) whose files carry ``payload``."""
    tag = root / "global_step1"
    tag.mkdir(parents=True)
    torch.save({"module": {}, "param_shapes": [{}], "payload": payload}, tag / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {"zero_stage": 2, "partition_count": 1, "payload": payload,
                                         "single_partition_of_fp32_groups": [torch.zeros(1)]}},
               tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (root / "latest").write_text("global_step1")
    return root


@pytest.mark.parametrize("make", [
    lambda marker: _Call(os.system, f"touch {marker}"),
    lambda marker: _Call(subprocess.call, ["touch", str(marker)]),
    lambda marker: _Call(eval, f"open({str(marker)!r}, 'w')"),
    lambda marker: _Call(getattr, _Call(__import__, "os"), "system"),
], ids=["os.system", "subprocess.call", "builtins.eval", "__import__"])
def test_payload_is_refused_and_never_runs(tmp_path: Path, make, capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "PWNED"
    root = _ds_dir(tmp_path / "ckpt", make(marker))
    with pytest.raises(zeroshard.CheckpointError, match=r"refusing to load .*_states\.pt: its pickle calls"):
        zeroshard.get_fp32_state_dict_from_zero_checkpoint(root)
    assert cli(["convert", str(root), str(tmp_path / "o"), "-q"]) == 2
    assert "refusing to load" in capsys.readouterr().err
    assert not marker.exists(), "the payload ran"


def test_protocol_5_payload_and_stack_global(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    data = pickle.dumps(_Call(os.system, f"touch {marker}"), protocol=5)  # STACK_GLOBAL
    with pytest.raises(zeroshard.CheckpointError, match="posix.system|os.system"):
        RestrictedUnpickler(io.BytesIO(data), tmp_path, {}).load()
    assert not marker.exists()


MOD = "zs_absent_fp16"


def test_foreign_classes_become_inert_records_without_imports(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # DeepSpeed's loss scaler, say: a class from a module that the loading process does not have.
    module = types.ModuleType(MOD)
    reduce = lambda self: (type(self), (2,))  # noqa: E731  (an enum pickles as a call of its class)
    scaler_cls = type("LossScaler", (), {"__module__": MOD})
    enum_cls = type("ZeroStageEnum", (), {"__module__": MOD, "__reduce__": reduce})
    module.LossScaler, module.ZeroStageEnum = scaler_cls, enum_cls
    monkeypatch.setitem(sys.modules, MOD, module)
    scaler = scaler_cls()
    scaler.cur_scale, scaler.cur_iter = 256.0, 3
    path = tmp_path / "f.pt"
    torch.save({"scaler": scaler, "stage": enum_cls(), "w": torch.arange(6.0).view(2, 3)[:, 1:]}, path)
    monkeypatch.delitem(sys.modules, MOD)
    got = load_restricted(path)
    assert isinstance(got["scaler"], InertRecord) and got["scaler"].foreign == "zs_absent_fp16.LossScaler"
    assert got["scaler"].cur_scale == 256.0 and got["scaler"].cur_iter == 3
    assert isinstance(got["stage"], InertRecord) and got["stage"].args == (2,)
    assert isinstance(got["w"], LazyTensor) and torch.equal(got["w"].load(), torch.arange(6.0).view(2, 3)[:, 1:])
    assert MOD not in sys.modules


def test_checkpoint_code_never_calls_torch_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ckpt"
    tag = root / "global_step1"
    tag.mkdir(parents=True)
    w = torch.arange(6.0)
    torch.save({"module": {"w": w}, "param_shapes": [{"w": torch.Size([6])}], "buffer_names": [],
                "shared_params": {}, "global_steps": 1}, tag / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {"zero_stage": 1, "partition_count": [1],
                                         "single_partition_of_fp32_groups": [w.clone()],
                                         "base_optimizer_state": {"state": {}, "param_groups": [{"params": [0]}]}}},
               tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (root / "latest").write_text("global_step1")

    def forbidden(*a, **k):
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    assert torch.equal(zeroshard.get_fp32_state_dict_from_zero_checkpoint(root)["w"], w)
