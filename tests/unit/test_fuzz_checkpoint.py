"""Fuzzed checkpoints: whatever happened to the files, loading them through the public API
(``engine.load_checkpoint``, ``get_fp32_state_dict_from_zero_checkpoint``, ``zeroshard convert``)
either gives exactly the saved state or raises one of zeroshard's errors naming the checkpoint's
file or directory. The files are never modified, nothing of a failed ``convert`` is left behind,
and no code carried by a pickle ever runs.

One real checkpoint is made in this process (a world of one, ZeRO stage 1, AdamW, a WarmupLR
schedule, a buffer and a frozen parameter); each example damages a copy of it:

- byte damage: truncation, bit flips, overwritten bytes, an emptied or deleted file (a missing
  shard), a file replaced by a pickle with a payload. Every byte of a zeroshard checkpoint is covered
  by a check (the metadata by the sha256 in ``COMPLETE``, shard sizes by the metadata, each
  safetensors header and 1 MiB data block by the CRC-32s in its header), so a load that succeeds must
  return the saved values bit for bit;
- forged damage: the metadata (``zeroshard.json``) or a safetensors header edited as a forger would,
  with every digest recomputed (wrong dtype or shape, missing or bogus keys, pieces pointing outside
  the directory); such a checkpoint may load other numbers, but may not crash the loader any other way.

DeepSpeed-format directories (``.pt`` pickles in zip archives, written here with ``torch.save``)
get the same byte damage, forged structures (values of the wrong type or shape, keys removed), and
pickles calling arbitrary (and dangerous) globals, alone, inside a genuine file or as a raw pickle
naming any module; a marker file shows whether a payload ever ran. Their tensor bytes carry no
checksum, so only clear errors (not equal values) are required of them.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import math
import os
import pickle
import random
import shutil
import struct
import subprocess
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import zeroshard
from zeroshard.checkpoint.paths import LATEST_FILE, MARKER_FILE, META_FILE, marker_text
from zeroshard.cli.main import main as cli
from zeroshard.errors import ZeroshardError

SCALE = float(os.environ.get("ZEROSHARD_FUZZ_SCALE", "1"))  # more examples for a longer search
FUZZ = settings(max_examples=int(150 * SCALE), deadline=None,
                # CI (CI=true) replays the same examples every run; elsewhere each run explores anew
                derandomize=bool(os.environ.get("CI")),
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
TAG, OLD_TAG = "step2", "step1"
MARKER_NAME = "PWNED"


class Net(nn.Module):
    """Trained parameters, a persistent buffer and a frozen parameter (so every file has content)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(6, 9), nn.LayerNorm(9), nn.Linear(9, 3)
        self.register_buffer("count", torch.zeros(2))
        self.scale = nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.b(torch.tanh(self.norm(self.a(x)))) * self.scale, y)


CONFIG = {
    "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "zero_optimization": {"stage": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
}


def fresh_engine() -> Any:
    torch.manual_seed(123)
    engine, *_ = zeroshard.initialize(model=Net(), config=CONFIG)
    return engine


def engine_state(engine: Any) -> dict[str, Any]:
    """What a load restores, as plain comparable values."""
    out: dict[str, Any] = {f"param/{n}": p.detach().clone() for n, p in engine.module.named_parameters()}
    out.update({f"buffer/{n}": b.detach().clone() for n, b in engine.module.named_buffers()})
    for i, state in enumerate(engine.optimizer.optimizer.state_dict()["state"].values()):
        out.update({f"optim/{i}/{k}": v.detach().clone() for k, v in state.items()})
    out["rng/torch"] = torch.get_rng_state()
    out["rng/python"] = random.getstate()
    out["rng/numpy"] = repr(np.random.get_state())
    out["lr"] = engine.lr_scheduler.get_last_lr()
    out["steps"] = (engine.global_steps, engine.global_samples, engine.skipped_steps)
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


class Saved(dict):  # type: ignore[type-arg]
    """A saved checkpoint: ``root``, ``expected`` (per tag: engine state, fp32 state dict), ``digest``."""

    def __repr__(self) -> str:  # hypothesis prints it with every falsifying example
        return f"Saved({self['root']})"


def tree_digest(root: Path) -> str:
    """Names and contents of everything under ``root``."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode() + b"\0")
        if p.is_file() and not p.is_symlink():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, process_group: None) -> dict[str, Any]:
    """The pristine checkpoint root and what loading it gives."""
    root = tmp_path_factory.mktemp("pristine") / "ckpt"
    torch.manual_seed(0)
    engine, *_ = zeroshard.initialize(model=Net(), config=CONFIG)
    x, y = torch.randn(2, 4, 6), torch.randint(0, 3, (2, 4))
    for step in range(2):
        engine.backward(engine(x[step], y[step]))
        engine.step()
        engine.save_checkpoint(root, tag=f"step{step + 1}", client_state={"epoch": step, "t": torch.arange(3)})
    expected = {}
    for tag in (TAG, OLD_TAG):
        e = fresh_engine()
        e.load_checkpoint(root, tag=tag)
        expected[tag] = (engine_state(e), zeroshard.get_fp32_state_dict_from_zero_checkpoint(root, tag=tag))
    return Saved(root=root, expected=expected, digest=tree_digest(root))


# ----------------------------------------------------------------------------------- loading


def check_error(error: BaseException, root: Path) -> None:
    """A zeroshard error whose message names the checkpoint (its root, tag directory or a file)."""
    assert isinstance(error, ZeroshardError), f"{type(error).__name__} escaped: {error!r}"
    assert str(root) in str(error), f"the message does not name the checkpoint: {error}"


def load_everything(root: Path, tmp: Path) -> dict[str, Any]:
    """Load ``root`` in every public way; returns what each gave (None: a clear error)."""
    results: dict[str, Any] = {"has_latest": (root / LATEST_FILE).is_file()}
    engine = fresh_engine()
    try:
        loaded, _ = engine.load_checkpoint(root)
        results["engine"] = engine_state(engine) if loaded is not None else "nothing"  # no latest: DeepSpeed's way
    except Exception as error:  # noqa: BLE001 - checked
        check_error(error, root)
        results["engine"] = None
    try:
        results["fp32"] = zeroshard.get_fp32_state_dict_from_zero_checkpoint(root)
    except Exception as error:  # noqa: BLE001
        check_error(error, root)
        results["fp32"] = None
    out = tmp / "converted"
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = cli(["convert", str(root), str(out), "-q"])
    if code == 0:
        results["convert"] = zeroshard.checkpoint.safetensors_io.SafetensorsReader(out / "model.safetensors")
        results["convert"].close()
    else:
        assert code == 2, f"convert exited with {code}: {stderr.getvalue()}"
        message = stderr.getvalue()
        assert "error:" in message and "Traceback" not in message and str(root) in message, message
        left = list(out.rglob("*")) if out.exists() else []
        assert not left, f"a failed convert left {left}"
        results["convert"] = None
    return results


def check_unchanged_or_error(results: dict[str, Any], saved: dict[str, Any], tags: tuple[str, ...]) -> None:
    """Every load that succeeded gave one of ``tags``' saved states exactly."""
    if results["engine"] == "nothing":
        assert not results["has_latest"], "nothing loaded although 'latest' exists"
    elif results["engine"] is not None:
        assert any(same(results["engine"], saved["expected"][t][0]) for t in tags), "loaded other values"
    if results["fp32"] is not None:
        assert any(same(results["fp32"], saved["expected"][t][1]) for t in tags), "loaded other values"


@contextlib.contextmanager
def damaged_copy(saved: dict[str, Any]) -> Iterator[tuple[Path, Path]]:
    with tempfile.TemporaryDirectory(prefix="zeroshard-fuzz-") as tmp:
        root = Path(tmp) / "ckpt"
        shutil.copytree(saved["root"], root)
        yield root, Path(tmp)
    assert tree_digest(saved["root"]) == saved["digest"], "the pristine checkpoint was modified"


# ----------------------------------------------------------------------------------- byte damage


class Payload:
    """Pickles as ``os.system("touch <marker>")``, as an attacker's object would."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return os.system, (f"touch {self.marker}",)


def pickled_payload(marker: Path, as_torch: bool) -> bytes:
    buf = io.BytesIO()
    obj = {"module": {}, "param_shapes": [{}], "x": Payload(marker)}
    if as_torch:
        torch.save(obj, buf)
    else:
        pickle.dump(obj, buf)
    return buf.getvalue()


FILES = [LATEST_FILE, f"{TAG}/{META_FILE}", f"{TAG}/{MARKER_FILE}", f"{TAG}/extra.safetensors",
         f"{TAG}/rank-00000-of-00001.safetensors"]


@st.composite
def byte_damage(draw: st.DrawFn, files: list[str]) -> tuple[str, str, Any]:
    name = draw(st.sampled_from(files))
    kind = draw(st.sampled_from(["truncate", "flip", "overwrite", "empty", "delete", "pickle", "append"]))
    if kind in ("truncate", "flip", "overwrite"):  # where: a fraction of the file's length
        return name, kind, (draw(st.floats(0, 1, exclude_max=True)), draw(st.integers(0, 7)),
                            draw(st.binary(min_size=1, max_size=16)))
    if kind == "append":
        return name, kind, draw(st.binary(min_size=1, max_size=16))
    return name, kind, draw(st.booleans())


def apply_byte_damage(root: Path, damage: tuple[str, str, Any], marker: Path) -> None:
    name, kind, arg = damage
    path = root / name
    if not path.is_file():
        return
    data = path.read_bytes()
    if kind in ("truncate", "flip", "overwrite"):
        where, bit, junk = arg
        at = int(where * len(data))
        if kind == "truncate":
            data = data[:at]
        elif kind == "flip" and data:
            data = data[:at] + bytes([data[at] ^ (1 << bit)]) + data[at + 1 :]
        else:
            data = data[:at] + junk + data[at + len(junk) :]
    elif kind == "append":
        data += arg
    elif kind == "empty":
        data = b""
    elif kind == "delete":
        path.unlink()
        return
    else:
        data = pickled_payload(marker, as_torch=arg)
    path.write_bytes(data)


@FUZZ
@given(st.lists(byte_damage(FILES), min_size=1, max_size=3))
def test_byte_damage_is_detected(saved: dict[str, Any], damages: list[tuple[str, str, Any]]) -> None:
    with damaged_copy(saved) as (root, tmp):
        marker = tmp / MARKER_NAME
        for damage in damages:
            apply_byte_damage(root, damage, marker)
        before = tree_digest(root)
        results = load_everything(root, tmp)
        assert tree_digest(root) == before, "loading modified the checkpoint directory"
        assert not marker.exists(), "a pickle payload ran"
    latest_touched = any(d[0] == LATEST_FILE for d in damages)
    check_unchanged_or_error(results, saved, (TAG, OLD_TAG) if latest_touched else (TAG,))


@settings(FUZZ, max_examples=int(100 * SCALE))
@given(st.lists(st.integers(0, 300), min_size=1, max_size=5), st.data())
def test_range_reads_check_exactly_the_blocks_they_touch(tmp_path: Path, sizes: list[int],
                                                         data: st.DataObject) -> None:
    """With 64-byte CRC blocks: any range of any tensor reads back exactly; after a bit flip, a
    read fails if and only if it touches the flipped block."""
    from zeroshard.checkpoint import safetensors_io as sio

    tensors = {f"t{i}": torch.randn(n) for i, n in enumerate(sizes)}
    specs = [sio.TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    path = tmp_path / "f.safetensors"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sio, "CRC_BLOCK", 64)
        sio.write_safetensors(path, specs, lambda spec: tensors[spec.name], checksums=True)
    name = data.draw(st.sampled_from(sorted(tensors)))
    numel = tensors[name].numel()
    lo = data.draw(st.integers(0, numel))
    hi = data.draw(st.integers(lo, numel))
    with sio.SafetensorsReader(path) as reader:
        assert torch.equal(reader.read(name, lo, hi), tensors[name][lo:hi])
        start = reader.info(name).begin
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    data_start = 8 + n
    if len(raw) == data_start:
        return
    at = data.draw(st.integers(data_start, len(raw) - 1))
    raw[at] ^= 1 << data.draw(st.integers(0, 7))
    path.write_bytes(bytes(raw))
    first, last = start + 4 * lo, start + 4 * hi  # the bytes the read needs
    touches = hi > lo and (first - data_start) // 64 <= (at - data_start) // 64 <= (last - 1 - data_start) // 64
    with sio.SafetensorsReader(path) as reader:
        if touches:
            with pytest.raises(zeroshard.CheckpointError, match="do not match their CRC-32"):
                reader.read(name, lo, hi)
        else:
            reader.read(name, lo, hi)


# ----------------------------------------------------------------------------------- forged damage

garbage = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats() | st.text(max_size=6)
    | st.sampled_from(["sharded", "scalar", "number", "../step1/zeroshard.json", "/etc/passwd", "F32", "I64",
                       "extra.safetensors", "rank-00000-of-00001.safetensors", "meta/0", -1, 0, 2**62]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6) | st.sampled_from(
        ["__tensor__", "__tuple__", "__items__", "start", "end", "file", "dynamic", "scale"]), inner, max_size=3),
    max_leaves=5,
)


def _json_paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for key, value in items:
        out.append((*prefix, key))
        out.extend(_json_paths(value, (*prefix, key)))
    return out


@st.composite
def edits(draw: st.DrawFn, doc: Any, values: st.SearchStrategy[Any] = garbage) -> Any:
    """A deep copy of ``doc`` (nested dicts and lists) with one to three values replaced by ``values``
    or removed."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        paths = _json_paths(doc)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        if draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = copy.deepcopy(draw(values))
    return doc


def read_header(path: Path) -> tuple[dict[str, Any], bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _header_bytes(header: dict[str, Any]) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def write_header(path: Path, header: dict[str, Any], payload: bytes) -> None:
    """Write a safetensors file; when it has zeroshard's CRC-32s, recompute them as a forger would
    (the header's over its bytes with the CRC text zeroed, then one per ``crc32_block`` data bytes)."""
    meta = header.get("__metadata__")
    if isinstance(meta, dict) and isinstance(meta.get("crc32"), str):
        block = int(meta["crc32_block"])
        blocks = [zlib.crc32(payload[i : i + block]) for i in range(0, len(payload), block)]
        meta["crc32"] = "0" * 8 * (1 + len(blocks))
        crcs = [zlib.crc32(_header_bytes(header)), *blocks]
        meta["crc32"] = "".join(f"{c:08x}" for c in crcs)
    raw = _header_bytes(header)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + payload)


def resign(tag_dir: Path) -> None:
    """Make ``zeroshard.json`` record the current file sizes and ``COMPLETE`` its digest."""
    meta_path = tag_dir / META_FILE
    try:
        meta = json.loads(meta_path.read_bytes())
        if isinstance(meta, dict) and isinstance(meta.get("files"), dict):
            for name in list(meta["files"]):
                if isinstance(name, str) and (tag_dir / name).is_file() and "/" not in name:
                    meta["files"][name] = (tag_dir / name).stat().st_size
            meta_path.write_bytes(json.dumps(meta, indent=1).encode())
    except ValueError:
        pass
    (tag_dir / MARKER_FILE).write_text(marker_text(meta_path.read_bytes()))


@FUZZ
@given(st.data())
def test_forged_metadata_fails_clearly(saved: dict[str, Any], data: st.DataObject) -> None:
    with damaged_copy(saved) as (root, tmp):
        tag_dir = root / TAG
        meta = json.loads((tag_dir / META_FILE).read_bytes())
        (tag_dir / META_FILE).write_bytes(json.dumps(data.draw(edits(meta))).encode())
        resign(tag_dir)
        before = tree_digest(root)
        load_everything(root, tmp)
        assert tree_digest(root) == before


def test_forgery_helpers_keep_a_valid_checkpoint_valid(saved: dict[str, Any]) -> None:
    """Re-signing unchanged files must load: the forged tests reach past every digest."""
    with damaged_copy(saved) as (root, tmp):
        for name in ("extra.safetensors", "rank-00000-of-00001.safetensors"):
            write_header(root / TAG / name, *read_header(root / TAG / name))
        (root / TAG / META_FILE).write_bytes(json.dumps(json.loads((root / TAG / META_FILE).read_bytes())).encode())
        resign(root / TAG)
        results = load_everything(root, tmp)
    assert all(results[k] is not None for k in ("engine", "fp32", "convert"))
    check_unchanged_or_error(results, saved, (TAG,))


ELEMENT_SIZE = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1, "BOOL": 1}


@st.composite
def consistent_header_edits(draw: st.DrawFn, header: dict[str, Any]) -> dict[str, Any]:
    """Edits that keep the header self-consistent (sizes match byte ranges) but lie about the data."""
    header = json.loads(json.dumps(header))
    names = sorted(header)
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(names))
        entry = header[name]
        numel = math.prod(entry["shape"])
        op = draw(st.sampled_from(["dtype", "reshape", "swap", "shrink"]))
        if op == "dtype":
            size = ELEMENT_SIZE[entry["dtype"]]
            entry["dtype"] = draw(st.sampled_from([c for c, n in ELEMENT_SIZE.items() if n == size]))
        elif op == "reshape":
            entry["shape"] = draw(st.sampled_from([[numel], [1, numel], [numel, 1]] + ([[]] if numel == 1 else [])))
        elif op == "swap":
            other = draw(st.sampled_from(names))
            header[name], header[other] = header[other], entry
        else:
            k = draw(st.integers(0, max(numel - 1, 0)))
            entry["shape"] = [k]
            entry["data_offsets"][1] = entry["data_offsets"][0] + k * ELEMENT_SIZE[entry["dtype"]]
    return header


@FUZZ
@given(st.data(), st.sampled_from(["extra.safetensors", "rank-00000-of-00001.safetensors"]), st.booleans())
def test_forged_safetensors_header_fails_clearly(saved: dict[str, Any], data: st.DataObject, name: str,
                                                 consistent: bool) -> None:
    with damaged_copy(saved) as (root, tmp):
        path = root / TAG / name
        header, payload = read_header(path)
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        edited = data.draw(consistent_header_edits(tensors) if consistent else edits(tensors))
        if isinstance(edited, dict):
            edited["__metadata__"] = header.get("__metadata__", {})
        write_header(path, edited, payload)
        resign(root / TAG)
        before = tree_digest(root)
        load_everything(root, tmp)
        assert tree_digest(root) == before


# ----------------------------------------------------------------------------------- DeepSpeed format


DS_MODEL, DS_OPTIM = "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def deepspeed_states() -> dict[str, Any]:
    """What DeepSpeed saves at stage 1 on one rank for :class:`Net`, by file name."""
    torch.manual_seed(5)
    net = Net()
    trained = {n: p.detach() for n, p in net.named_parameters() if p.requires_grad}
    flat = torch.cat([p.reshape(-1) for p in trained.values()])
    group = {"params": [0], "lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
             "amsgrad": False}
    return {
        DS_MODEL: {"module": net.state_dict(), "param_shapes": [{n: p.shape for n, p in trained.items()}],
                   "buffer_names": ["count"], "shared_params": {}, "frozen_param_shapes": None, "global_steps": 2,
                   "global_samples": 8, "skipped_steps": 0, "lr_scheduler": None, "dp_world_size": 1},
        DS_OPTIM: {"optimizer_state_dict": {
            "zero_stage": 1, "partition_count": [1], "loss_scaler": None, "dynamic_loss_scale": False,
            "single_partition_of_fp32_groups": [flat.clone()],
            "base_optimizer_state": {"state": {0: {"step": torch.tensor(2.0), "exp_avg": flat * 0.1,
                                                   "exp_avg_sq": flat * flat}}, "param_groups": [group]}}},
    }


def deepspeed_dir(root: Path, states: dict[str, Any] | None = None) -> Path:
    """A DeepSpeed checkpoint directory (``latest`` and one tag) holding ``states``."""
    tag = root / "global_step2"
    tag.mkdir(parents=True)
    for name, obj in (states or deepspeed_states()).items():
        torch.save(obj, tag / name)
    (root / "latest").write_text("global_step2")
    return root


@pytest.fixture(scope="module")
def deepspeed_saved(tmp_path_factory: pytest.TempPathFactory, process_group: None) -> dict[str, Any]:
    root = deepspeed_dir(tmp_path_factory.mktemp("ds") / "ckpt")
    e = fresh_engine()
    e.load_checkpoint(root)
    expected = {"global_step2": (engine_state(e), zeroshard.get_fp32_state_dict_from_zero_checkpoint(root))}
    return Saved(root=root, expected=expected, digest=tree_digest(root))


DS_FILES = [LATEST_FILE, f"global_step2/{DS_MODEL}", f"global_step2/{DS_OPTIM}"]


@settings(FUZZ, max_examples=int(100 * SCALE))
@given(st.lists(byte_damage(DS_FILES), min_size=1, max_size=2))
def test_deepspeed_byte_damage_fails_clearly(deepspeed_saved: dict[str, Any], damages: list[Any]) -> None:
    with damaged_copy(deepspeed_saved) as (root, tmp):
        marker = tmp / MARKER_NAME
        for damage in damages:
            apply_byte_damage(root, damage, marker)
        before = tree_digest(root)
        load_everything(root, tmp)
        assert tree_digest(root) == before
        assert not marker.exists(), "a pickle payload ran"


ds_garbage = garbage | st.sampled_from([torch.zeros(3), torch.zeros(0), torch.ones(2, 2), torch.Size([4]),
                                         torch.tensor(7), (1, 2), {0: {}}, [torch.zeros(1)]])


@settings(FUZZ, max_examples=int(150 * SCALE))
@given(st.data(), st.sampled_from([DS_MODEL, DS_OPTIM]))
def test_forged_deepspeed_structures_fail_clearly(deepspeed_saved: dict[str, Any], data: st.DataObject,
                                                  name: str) -> None:
    states = deepspeed_states()
    states[name] = data.draw(edits(states[name], ds_garbage))
    with tempfile.TemporaryDirectory(prefix="zeroshard-fuzz-") as tmp:
        root = deepspeed_dir(Path(tmp) / "ckpt", states)
        before = tree_digest(root)
        load_everything(root, Path(tmp))
        assert tree_digest(root) == before


DANGEROUS_CALLS: list[tuple[Callable[..., Any], Callable[[Path], tuple[Any, ...]]]] = [
    (os.system, lambda m: (f"touch {m}",)),
    (subprocess.call, lambda m: (["touch", str(m)],)),
    (subprocess.Popen, lambda m: (["touch", str(m)],)),
    (eval, lambda m: (f"open({str(m)!r}, 'w')",)),
    (exec, lambda m: (f"open({str(m)!r}, 'w')",)),
    (open, lambda m: (str(m), "w")),
    (shutil.copy, lambda m: (__file__, str(m))),
    (Path.touch, lambda m: (m,)),
]


class Call:
    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return self.fn, self.args


def _raw_global_call(module: str, name: str, arg: str) -> bytes:
    """A protocol-2 pickle of ``module.name(arg)`` for any (even made-up) module and name."""
    return (b"\x80\x02c" + module.encode() + b"\n" + name.encode() + b"\n" + pickle.dumps(arg, protocol=2)[2:-1]
            + b"\x85R.")


@settings(FUZZ, max_examples=int(100 * SCALE))
@given(st.integers(0, len(DANGEROUS_CALLS) - 1), st.sampled_from([DS_MODEL, DS_OPTIM]),
       st.sampled_from(["alone", "inside", "raw"]),
       st.tuples(st.sampled_from(["os", "posix", "builtins", "subprocess", "torch", "torch.serialization", "numpy",
                                  "deepspeed.runtime", "zeroshard.checkpoint.unpickle", "collections", "copyreg",
                                  "importlib", "runpy", "pickle", "functools"]) | st.text(min_size=1, max_size=12),
                 st.sampled_from(["system", "load", "eval", "exec", "call", "_reconstructor", "import_module",
                                  "run_path", "partial", "__import__", "OrderedDict", "Size"])
                 | st.text(min_size=1, max_size=12)))
def test_deepspeed_pickle_payloads_never_run(deepspeed_saved: dict[str, Any], which: int, name: str, where: str,
                                             global_: tuple[str, str]) -> None:
    with damaged_copy(deepspeed_saved) as (root, tmp):
        marker = tmp / MARKER_NAME
        path = root / "global_step2" / name
        fn, args = DANGEROUS_CALLS[which]
        payload = Call(fn, args(marker))
        if where == "alone":
            torch.save(payload, path)
        elif where == "inside":  # a genuine file with the payload among its values
            obj = deepspeed_states()[name]
            obj["extra"], obj["nested"] = payload, [{"deep": payload}]
            torch.save(obj, path)
        else:  # the archive's data.pkl replaced by a pickle calling any global, even a made-up one
            module, attr = (part.replace("\n", "") for part in global_)
            buf = io.BytesIO()
            with zipfile.ZipFile(path) as zf, zipfile.ZipFile(buf, "w") as out:
                for item in zf.infolist():
                    body = zf.read(item)
                    if item.filename.endswith("/data.pkl"):
                        body = _raw_global_call(module, attr, f"touch {marker}")
                    out.writestr(item, body)
            path.write_bytes(buf.getvalue())
        before = tree_digest(root)
        load_everything(root, tmp)
        assert tree_digest(root) == before
        assert not marker.exists(), "a pickle payload ran"
