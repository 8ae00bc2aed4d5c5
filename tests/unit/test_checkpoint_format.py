"""Checkpoint building blocks, single process: safetensors streaming, JSON encoding, tags and
crash-safe publishing, the resumable sampler, shard planning and the ``convert`` command's errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DistributedSampler

from zeroshard.checkpoint import atomic, paths
from zeroshard.checkpoint.consolidate import _plan, parse_size
from zeroshard.checkpoint.dataloader import ResumableDataLoader, ResumableDistributedSampler
from zeroshard.checkpoint.jsonable import TensorTable, decode, encode
from zeroshard.checkpoint.safetensors_io import SafetensorsReader, TensorSpec, write_safetensors
from zeroshard.cli.main import main as cli
from zeroshard.errors import CheckpointError

TENSORS = {
    "f32": torch.randn(3, 5), "bf16": torch.randn(7).bfloat16(), "f16": torch.randn(2, 2).half(),
    "i64": torch.arange(4), "bool": torch.tensor([True, False, True]), "u8": torch.arange(9, dtype=torch.uint8),
    "scalar": torch.tensor(2.5), "empty": torch.zeros(0), "f64": torch.randn(3).double(),
}


def _write(path: Path, tensors: dict[str, torch.Tensor], **kw) -> int:
    specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    return write_safetensors(path, specs, lambda s: tensors[s.name], {"who": "test"}, **kw)


def test_streamed_file_is_standard_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    size = _write(path, TENSORS)
    assert size == path.stat().st_size
    loaded = load_file(path)
    assert set(loaded) == set(TENSORS) and all(torch.equal(loaded[k], v) for k, v in TENSORS.items())
    with SafetensorsReader(path) as r:
        assert r.metadata == {"who": "test"}
        assert torch.equal(r.read("f32", 4, 11), TENSORS["f32"].reshape(-1)[4:11])
        assert torch.equal(r.read("bf16").view(7), TENSORS["bf16"])
        out = torch.empty(2, dtype=torch.int64)
        assert r.read("i64", 1, 3, out=out) is out and out.tolist() == [1, 2]


def test_reader_accepts_library_files_and_refuses_damage(tmp_path: Path) -> None:
    lib = tmp_path / "lib.safetensors"
    save_file({"w": torch.randn(4, 4), "b": torch.ones(3, dtype=torch.bfloat16)}, lib, metadata={"format": "pt"})
    with SafetensorsReader(lib) as r:
        assert torch.equal(r.read("w").view(4, 4), load_file(lib)["w"])
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(lib.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="cut.safetensors is truncated"):
        SafetensorsReader(truncated)
    damaged = {"pickle.safetensors": b"\x80\x02}q\x00.", "junk.safetensors": b"\x05" + b"\x00" * 7 + b"{oops"}
    for name, data in damaged.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(CheckpointError, match=name):
            SafetensorsReader(tmp_path / name)


def test_json_encoding_round_trip_and_refusal() -> None:
    value = {"a": (1, 2.5, None), 3: [torch.arange(2), {"__tensor__": "x"}], "nan": math.inf, "s": "é", "b": True}
    table = TensorTable("c/")
    encoded = json.loads(json.dumps(encode(value, table, "client_state")))
    back = decode(encoded, table.tensors)
    assert back["a"] == (1, 2.5, None) and back["nan"] == math.inf and back["s"] == "é" and back["b"] is True
    assert torch.equal(back[3][0], torch.arange(2)) and back[3][1] == {"__tensor__": "x"}
    with pytest.raises(CheckpointError, match=r"client_state\['k'\]\[1\] holds a pathlib"):
        encode({"k": [1, Path("/")]}, table, "client_state")
    # numpy scalars as the numbers they are (a numpy bool from `loss < best` was refused)
    assert encode({"best": np.bool_(True), "n": np.int64(3), "x": np.float32(0.5)}, table, "c") == \
        {"best": True, "n": 3, "x": 0.5}
    # tensors no file can hold: refused while encoding, before any write, naming where they are
    # (a sparse one failed inside the writer with torch's "unsupported memory format option")
    with pytest.raises(CheckpointError, match=r"client_state\['m'\] is a torch.sparse_coo tensor"):
        encode({"m": torch.eye(2).to_sparse()}, table, "client_state")
    with pytest.raises(CheckpointError, match=r"client_state\['z'\]: dtype torch.complex64"):
        encode({"z": torch.zeros(2, dtype=torch.complex64)}, table, "client_state")


def _complete(d: Path) -> None:
    d.mkdir(parents=True)
    raw = b'{"format": "zeroshard"}'
    (d / paths.META_FILE).write_bytes(raw)
    (d / paths.MARKER_FILE).write_text(paths.marker_text(raw))


def test_tags_latest_and_incomplete_directories(tmp_path: Path) -> None:
    assert paths.resolve_checkpoint(tmp_path / "missing", None) is None  # DeepSpeed: nothing to resume
    assert paths.resolve_checkpoint(tmp_path, None) is None
    _complete(tmp_path / "step1")
    atomic.write_file_atomic(tmp_path / "latest", b"step1")
    assert paths.resolve_checkpoint(tmp_path, None) == tmp_path / "step1"
    assert paths.resolve_checkpoint(tmp_path / "step1", None) == tmp_path / "step1"
    (tmp_path / ".tmp-step2-abcd").mkdir()
    with pytest.raises(CheckpointError, match="interrupted.*tmp-step2-abcd"):
        paths.resolve_checkpoint(tmp_path, "step2")
    with pytest.raises(CheckpointError, match=r"\.tmp-step2-abcd is an incomplete checkpoint"):
        paths.resolve_checkpoint(tmp_path, ".tmp-step2-abcd")
    (tmp_path / "step3").mkdir()
    (tmp_path / "step3" / paths.META_FILE).write_text("{}")
    with pytest.raises(CheckpointError, match="step3 is an incomplete zeroshard checkpoint"):
        paths.resolve_checkpoint(tmp_path, "step3")
    (tmp_path / "step1" / paths.META_FILE).write_text('{"changed": 1}')
    with pytest.raises(CheckpointError, match="does not match the digest"):
        paths.resolve_checkpoint(tmp_path, "step1")
    (tmp_path / "other").mkdir()
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        paths.resolve_checkpoint(tmp_path, "other")
    with pytest.raises(CheckpointError, match="no checkpoint 'step9'.*step1"):
        paths.resolve_checkpoint(tmp_path, "step9")


def test_publish_replaces_a_tag_and_survives_a_crash_in_between(tmp_path: Path) -> None:
    _complete(tmp_path / ".tmp-a-1")
    atomic.publish_dir(tmp_path / ".tmp-a-1", tmp_path / "a")
    _complete(tmp_path / ".tmp-a-2")
    (tmp_path / ".tmp-a-2" / "new").touch()
    atomic.publish_dir(tmp_path / ".tmp-a-2", tmp_path / "a")
    assert (tmp_path / "a" / "new").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    # A crash after moving the old copy aside and before renaming the new one: the old copy is used.
    (tmp_path / "a").rename(tmp_path / ".old-a-3")
    assert paths.resolve_checkpoint(tmp_path, "a") == tmp_path / ".old-a-3"


def test_fault_point_only_fires_for_its_phase_and_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(atomic.FAULT_ENV, "renamed@1")
    atomic.fault_point("renamed", 0)
    atomic.fault_point("meta_written", 1)  # still alive


@pytest.mark.parametrize("n,world,shuffle,drop_last", [(23, 4, True, False), (23, 4, True, True), (8, 3, False, False),
                                                      (2, 4, True, False), (40, 2, True, False)])
def test_sampler_matches_distributed_sampler(n: int, world: int, shuffle: bool, drop_last: bool) -> None:
    data = list(range(n))
    for rank in range(world):
        ours = ResumableDistributedSampler(data, world, rank, shuffle=shuffle, drop_last=drop_last)
        theirs = DistributedSampler(data, world, rank, shuffle=shuffle, drop_last=drop_last)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


def test_loader_resumes_mid_epoch_at_any_world_size() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(48))

    def loader(world: int, rank: int) -> ResumableDataLoader:
        return ResumableDataLoader(data, 3, ResumableDistributedSampler(data, world, rank))

    first = [loader(2, r) for r in range(2)]
    consumed = []
    for ld in first:
        ld.sampler.set_epoch(1)
        it = iter(ld)
        consumed += [int(v) for _ in range(3) for v in next(it)[0]]
    state = first[0].state_dict()
    assert state["epoch"] == 1 and state["consumed"] == 18 and first[1].state_dict() == state
    # Same world size: the very batches the uninterrupted loader would give next.
    again = loader(2, 0)
    again.load_state_dict(state)
    full = [b[0].tolist() for b in first[0]]
    assert [b[0].tolist() for b in again] == full[3:]
    # Four ranks: every remaining sample once (plus DistributedSampler's padding to a multiple of 4).
    rest = []
    for r in range(4):
        ld = loader(4, r)
        ld.load_state_dict(state)
        ld.sampler.set_epoch(1)  # the same epoch keeps the restored position
        rest += [int(v) for b in ld for v in b[0]]
    assert sorted(set(consumed + rest)) == list(range(48)) and len(rest) == 30 + (-30 % 4)


def test_sizes_and_shard_plan() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2**31 and parse_size(7) == 7
    with pytest.raises(ValueError, match="5 parsecs"):
        parse_size("5 parsecs")
    specs = [TensorSpec(str(i), torch.float32, (n,)) for i, n in enumerate([10, 10, 30, 5])]
    assert [[s.name for s in shard] for shard in _plan(specs, 80)] == [["0", "1"], ["2"], ["3"]]
    assert len(_plan(specs, None)) == 1


def test_convert_command_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli(["convert", str(tmp_path / "nowhere"), str(tmp_path / "o.safetensors")])
    assert info.value.code == 2 and "nowhere does not exist" in capsys.readouterr().err
    (tmp_path / ".tmp-s-1").mkdir()
    assert cli(["convert", str(tmp_path), str(tmp_path / "o.safetensors"), "--tag", "s"]) == 2
    assert "interrupted" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli(["convert", str(tmp_path), str(tmp_path / "o"), "--max-shard-size", "lots"])
    assert info.value.code == 2
