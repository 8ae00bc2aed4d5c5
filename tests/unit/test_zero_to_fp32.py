"""Conversions, single process: ``zeroshard.utils.zero_to_fp32`` (DeepSpeed's flags, file names and
functions) and ``convert --to deepspeed`` (DeepSpeed's flat layouts at any world size and stage,
read back by zeroshard's DeepSpeed reader, which never unpickles)."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

import zeroshard
from zeroshard.checkpoint.metadata import CheckpointMeta
from zeroshard.checkpoint.open import open_source
from zeroshard.checkpoint.source import MASTER
from zeroshard.checkpoint.to_deepspeed import (
    DeepSpeedTarget,
    clipping,
    partition_size_12,
    sub_groups_3,
    write_deepspeed_checkpoint,
)
from zeroshard.cli.main import main as cli
from zeroshard.deepspeed.utils import zero_to_fp32 as z2f
from zeroshard.errors import CheckpointError


class TiedNet(nn.Module):
    """Tied embeddings, a buffer, a frozen layer, and two param groups (decay / no decay)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.norm, self.frozen = nn.Embedding(13, 7), nn.LayerNorm(7), nn.Linear(7, 7)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(7, 13, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("seen", torch.zeros(3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.frozen(self.norm(self.emb(x)))), y)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    created = not dist.is_initialized()
    root = tmp_path_factory.mktemp("z2f") / "ckpt"
    torch.manual_seed(0)
    model = TiedNet()
    groups = [{"params": [model.emb.weight]}, {"params": list(model.norm.parameters()), "weight_decay": 0.0}]
    engine, *_ = zeroshard.initialize(model=model, model_parameters=groups, config={
        "train_micro_batch_size_per_gpu": 5, "gradient_clipping": 1.0, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    for _ in range(2):
        engine.backward(engine(torch.randint(0, 13, (5,)), torch.randint(0, 13, (5,))))
        engine.step()
    engine.save_checkpoint(root, client_state={"epoch": 3})
    yield root
    if created and dist.is_initialized():
        dist.destroy_process_group()


def test_cli_writes_deepspeeds_files(ckpt: Path, tmp_path: Path) -> None:
    want = z2f.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    assert "head.weight" in want and want["head.weight"] is want["emb.weight"]  # tied: both names, as DeepSpeed
    assert z2f.main([str(ckpt), str(tmp_path / "bin")]) == 0
    got = torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype
                                           for k in want)
    assert z2f.main([str(ckpt), str(tmp_path / "st"), "--safe_serialization", "--max_shard_size", "200B",
                     "-t", "global_step2", "--exclude_frozen_parameters"]) == 0
    index = json.loads((tmp_path / "st" / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in (tmp_path / "st").glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    loaded = {k: v for s in shards for k, v in load_file(tmp_path / "st" / s).items()}
    expected = {k for k in want if not k.startswith("frozen.") and k != "head.weight"}  # tied once in safetensors
    assert set(loaded) == expected == set(index["weight_map"])
    assert all(torch.equal(loaded[k], want[k]) for k in expected)
    assert z2f.main([str(ckpt), str(tmp_path / "sh"), "--max_shard_size", "300B"]) == 0
    bin_index = json.loads((tmp_path / "sh" / "pytorch_model.bin.index.json").read_text())
    assert set(bin_index["weight_map"]) == set(want)
    model = z2f.load_state_dict_from_zero_checkpoint(TiedNet(), ckpt)
    assert torch.equal(model.emb.weight, want["emb.weight"]) and torch.equal(model.seen, want["seen"])


def test_cli_errors_name_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert z2f.main([str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert "nope does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert z2f.main([str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert "no 'latest' file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        z2f.main([str(tmp_path), str(tmp_path / "out"), "--max_shard_size", "lots"])
    with pytest.raises(ValueError, match="unsupported output dtype"):
        z2f.convert_zero_checkpoint_to_state_dict(tmp_path, tmp_path / "out", dtype="int8")


def test_convert_replaces_a_previous_export_and_names_path_errors(ckpt: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A second export into the same directory leaves no weight file of the first: from_pretrained
    prefers model.safetensors to an index, so a stale one would load old weights."""
    from safetensors.torch import save_file

    want = z2f.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    out = tmp_path / "export"
    out.mkdir()
    stale = {"emb.weight": torch.full((13, 7), 9.0)}
    for name in ("model.safetensors", "model-00001-of-00009.safetensors", "model-00009-of-00009.safetensors"):
        save_file(stale, out / name)
    index = {"weight_map": {"emb.weight": "model-00001-of-00009.safetensors"}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "notes.txt").write_text("mine")
    assert cli(["convert", str(ckpt), str(out), "-q", "--max-shard-size", "200B"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert {p.name for p in out.glob("model*")} == shards | {"model.safetensors.index.json"}
    assert (out / "notes.txt").read_text() == "mine"  # not a weight file: kept
    loaded = {k: v for s in shards for k, v in load_file(out / s).items()}
    assert torch.equal(loaded["emb.weight"], want["emb.weight"])
    assert cli(["convert", str(ckpt), str(out), "-q"]) == 0  # back to one file: the shards and index go
    assert {p.name for p in out.glob("model*")} == {"model.safetensors"}
    assert torch.equal(load_file(out / "model.safetensors")["emb.weight"], want["emb.weight"])

    (tmp_path / "afile").write_text("")
    for args in ([str(ckpt), str(tmp_path / "afile" / "out")], [str(ckpt), str(tmp_path / "afile" / "o.safetensors")],
                 [str(ckpt), str(tmp_path / "afile" / "ds"), "--to", "deepspeed", "--world-size", "1"]):
        with pytest.raises(SystemExit) as info:
            cli(["convert", "-q", *args])
        assert info.value.code == 2 and "afile is a file, not a directory" in capsys.readouterr().err, args
    import errno

    import zeroshard.checkpoint.consolidate as consolidate

    def full_disk(path: Path, *_: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(consolidate, "write_safetensors", full_disk)  # failing while writing: exit 2, no traceback
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert cli(["convert", "-q", str(ckpt), str(out), "--max-shard-size", "200B"]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the previous export is untouched
    with pytest.raises(SystemExit) as info:
        cli(["convert", str(tmp_path / "afile"), str(tmp_path / "out")])
    assert info.value.code == 2 and "afile is a file, not a directory" in capsys.readouterr().err


def test_deepspeed_layout_math() -> None:
    # DeepSpeed 0.19, 1770 elements on 2 ranks: partitions of 886 (rank 1 holds 884 + 2 padding)
    assert partition_size_12(1770, 2) == 886 and partition_size_12(1770, 3) == 590 and partition_size_12(5, 4) == 2
    assert sub_groups_3([4, 4, 4], 10**9) == [[0, 1, 2]]
    assert sub_groups_3([4, 4, 4, 1], 8) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_to_deepspeed_at_any_world_size(ckpt: Path, tmp_path: Path, stage: int) -> None:
    """Every element of masters, moments and step survives zeroshard -> DeepSpeed(N) -> zeroshard's reader."""
    with open_source(ckpt / "global_step2") as zs:
        for world in (1, 2, 3, 4):
            out = tmp_path / f"w{world}"
            target = DeepSpeedTarget(world, stage, torch.bfloat16, sub_group_size=40)
            write_deepspeed_checkpoint(ckpt, out, target)
            tag = out / "global_step2"
            prefix = sorted(p.name for p in tag.iterdir())
            assert sum(n.startswith("bf16_zero_pp_rank_") for n in prefix) == world, prefix
            with open_source(tag) as ds:
                assert (ds.format, ds.world_size, ds.zero_stage) == ("deepspeed", world, stage)
                assert list(ds.params) == list(zs.params) and ds.aliases == zs.aliases
                assert ds.counters["global_steps"] == 2 and ds.client_state["epoch"] == 3
                assert ds.lr_scheduler == zs.lr_scheduler
                for name, p in zs.params.items():
                    for key in (MASTER, "exp_avg", "exp_avg_sq"):
                        assert torch.equal(ds.read(key, name, 0, p.numel), zs.read(key, name, 0, p.numel)), (key, name)
                    assert float(ds.read_scalar("step", name)) == 2.0
                for name in (*zs.buffers, *zs.frozen):
                    assert torch.equal(ds.read_extra(name), zs.read_extra(name).bfloat16())
                assert ds.param_groups == [{**g, "bias_correction": True} for g in zs.param_groups or []]
            assert (out / "latest").read_text() == "global_step2"
    with pytest.raises(CheckpointError, match="already exists"):
        write_deepspeed_checkpoint(ckpt, tmp_path / "w1", DeepSpeedTarget(1, stage, torch.float32))


def test_to_deepspeed_refusals_and_cli(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(CheckpointError, match="stages 1, 2 and 3"):
        DeepSpeedTarget(2, 0, torch.float32)
    with pytest.raises(CheckpointError, match="at least 1"):
        DeepSpeedTarget(0, 2, torch.float32)
    with pytest.raises(SystemExit):
        cli(["convert", str(ckpt), str(tmp_path / "x"), "--to", "deepspeed"])
    assert "--world-size" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("[1]")
    assert cli(["convert", str(ckpt), str(tmp_path / "x"), "--to", "deepspeed", "--world-size", "2",
                "--ds-config", str(tmp_path / "bad.json")]) == 2
    assert "bad.json is not a JSON object" in capsys.readouterr().err
    (tmp_path / "fp16.json").write_text(json.dumps({"fp16": {"enabled": True, "loss_scale_window": 50},
                                                    "zero_optimization": {"stage": 1}, "gradient_clipping": 0.5}))
    assert cli(["convert", str(ckpt), str(tmp_path / "fp16"), "--to", "deepspeed", "--world-size", "2",
                "--ds-config", str(tmp_path / "fp16.json"), "--quiet"]) == 0
    files = sorted(p.name for p in (tmp_path / "fp16" / "global_step2").iterdir())
    assert files == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                     "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    with open_source(tmp_path / "fp16" / "global_step2") as ds:
        assert ds.zero_stage == 1 and ds.loss_scaler is not None and ds.loss_scaler["dynamic"] is True
    if importlib.util.find_spec("deepspeed") is not None:  # our own file: safe to unpickle with DeepSpeed's classes
        osd = torch.load(tmp_path / "fp16" / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                         weights_only=False)["optimizer_state_dict"]
        scaler = osd["loss_scaler"]
        assert type(scaler).__name__ == "DynamicLossScaler" and scaler.scale_window == 50
        assert osd["clip_grad"] == 0.5 and int(osd["zero_stage"]) == 1


def test_a_hugging_face_auto_config_takes_the_checkpoints_values(ckpt: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """transformers' DeepSpeed configs leave values "auto" (filled from the training arguments at run
    time): the conversion takes them from the checkpoint, which records the clipping (1.0) and
    precision (bf16) it trained with, and DeepSpeed's reader then sees them in the files."""
    auto = {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}, "gradient_clipping": "auto",
            "zero_optimization": {"stage": 2, "sub_group_size": "auto"}, "train_batch_size": "auto"}
    (tmp_path / "auto.json").write_text(json.dumps(auto))
    assert cli(["convert", str(ckpt), str(tmp_path / "auto"), "--to", "deepspeed", "--world-size", "2",
                "--ds-config", str(tmp_path / "auto.json"), "--quiet"]) == 0
    files = sorted(p.name for p in (tmp_path / "auto" / "global_step2").iterdir())
    assert files[0].startswith("bf16_zero_pp_rank_0"), files  # the checkpoint's bf16, not "auto" read as on
    with open_source(tmp_path / "auto" / "global_step2") as ds:
        assert ds.zero_stage == 2 and ds.gradient_clipping == 1.0
    off = {**auto, "bf16": {"enabled": False}, "fp16": {"enabled": False}, "gradient_clipping": 0.25}
    (tmp_path / "off.json").write_text(json.dumps(off))
    assert cli(["convert", str(ckpt), str(tmp_path / "off"), "--to", "deepspeed", "--world-size", "2",
                "--ds-config", str(tmp_path / "off.json"), "--quiet"]) == 0
    with open_source(tmp_path / "off" / "global_step2") as ds:
        assert ds.gradient_clipping == 0.25 and not any(ds.path.glob("bf16_*"))
    (tmp_path / "bad.json").write_text(json.dumps({**auto, "gradient_clipping": "one"}))
    assert cli(["convert", str(ckpt), str(tmp_path / "bad"), "--to", "deepspeed", "--world-size", "2",
                "--ds-config", str(tmp_path / "bad.json")]) == 2
    assert "gradient_clipping is 'one', expected a number or \"auto\"" in capsys.readouterr().err


def test_metadata_of_a_newer_writer_loads(ckpt: Path, tmp_path: Path) -> None:
    """An optional key a newer zeroshard adds is ignored with a warning naming it; without the
    recorded clipping (files saved before it was recorded) the value is None, and the conversion
    writes DeepSpeed's default with a warning unless told the job's value."""
    raw = json.loads((ckpt / "global_step2" / "zeroshard.json").read_text())
    assert raw["gradient_clipping"] == 1.0
    (tmp_path / "newer.json").write_text(json.dumps({**raw, "sparse_layout": {"x": 1}}))
    with pytest.warns(UserWarning, match="ignoring keys this zeroshard does not know: sparse_layout"):
        meta = CheckpointMeta.from_file(tmp_path / "newer.json")
    assert meta == CheckpointMeta.from_file(ckpt / "global_step2" / "zeroshard.json")
    (tmp_path / "older.json").write_text(json.dumps({k: v for k, v in raw.items() if k != "gradient_clipping"}))
    assert CheckpointMeta.from_file(tmp_path / "older.json").gradient_clipping is None
    old = SimpleNamespace(path=tmp_path, gradient_clipping=None)
    with pytest.warns(UserWarning, match="does not record its gradient clipping; the DeepSpeed checkpoint says 0"):
        assert clipping(DeepSpeedTarget(2, 2, torch.float32), old) == 0.0  # type: ignore[arg-type]
    assert clipping(DeepSpeedTarget(2, 2, torch.float32, 0.3), old) == 0.3  # type: ignore[arg-type]
