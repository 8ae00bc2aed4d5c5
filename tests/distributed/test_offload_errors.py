"""NVMe offload fails loudly: bad paths before training, I/O errors at the step that meets them.

Before training (``initialize``): ``device: nvme`` without ``nvme_path``, a path that does not
exist, a path that is a file, and a filesystem with too little free space (``shutil.disk_usage``
replaced in the worker) are each a :class:`~zeroshard.errors.ConfigError` whose ``key`` is the
``nvme_path`` key and whose message names the path (and, for space, the bytes needed and the
bytes available), for the optimizer's and the parameters' paths; nothing is left in the paths.

During training: ``os.pwrite`` failing with ``ENOSPC`` and ``os.preadv`` failing with ``EIO`` (the
calls the I/O engine, ``offload/aio.py``, makes), armed after two good steps, and a swap file cut
to nothing behind the engine's back (a read that comes back short, which must not read as zeros),
each surface from ``engine.step()`` as :class:`~zeroshard.errors.OffloadIOError` naming the swap
file, its errno, and the optimizer step: a failed read from the step that reads, a failed write
from the next step (a step's last writes run on under the next forward and backward), or from a
checkpoint save, which then publishes nothing; a failing read of ZeRO-3's parameter swap file
surfaces from the forward. After each, ``engine.destroy()`` removes the swap directory. A clean
interpreter exit without ``destroy()`` removes it too (the ``atexit`` hook); a process that dies
with ``os._exit`` does not, which shows that the hook, not luck, did it.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from harness import run_distributed
from models import make_data, make_model
from teardown import ABORT_MARKS, died_in_teardown

import zeroshard
from zeroshard.errors import ConfigError, OffloadIOError

OPT_KEY = "zero_optimization.offload_optimizer.nvme_path"
PARAM_KEY = "zero_optimization.offload_param.nvme_path"
MB = 4


def config(stage: int, opt_path: str | None, param_path: str | None = None, *, params: bool = False) -> dict[str, Any]:
    z: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 1000, "sub_group_size": 500,
                         "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 500,
                         "offload_optimizer": {"device": "nvme", "buffer_count": 2}}
    if opt_path is not None:
        z["offload_optimizer"]["nvme_path"] = opt_path
    if params:
        z["offload_param"] = {"device": "nvme", "buffer_count": 2, "buffer_size": 5000}
        if param_path is not None:
            z["offload_param"]["nvme_path"] = param_path
    return {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "zero_optimization": z, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def _init_error(cfg: dict[str, Any]) -> dict[str, Any]:
    """What ``initialize`` raised for ``cfg`` (it must raise ConfigError)."""
    try:
        engine, *_ = zeroshard.initialize(model=make_model(0), config=cfg)
    except ConfigError as e:
        return {"key": e.key, "message": str(e)}
    engine.destroy()
    return {"key": None, "message": "initialize did not raise"}


@contextmanager
def _replaced(module: Any, name: str, fake: Callable[..., Any]) -> Iterator[None]:
    """Replace ``module.name`` inside this spawned worker only, for the ``with`` block."""
    real = getattr(module, name)
    setattr(module, name, fake)
    try:
        yield
    finally:
        setattr(module, name, real)


def _runs_left(path: str | Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("zeroshard-swap-"))


def config_errors(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    good, missing, a_file = root / "good", root / "missing", root / "a_file"
    good.mkdir()
    a_file.write_text("not a directory")
    out["no key"] = _init_error(config(2, None))
    out["no key params"] = _init_error(config(3, str(good), None, params=True))
    # a path that does not exist is created, as DeepSpeed does (its own NVMe tests name one)
    engine, *_ = zeroshard.initialize(model=make_model(0), config=config(3, str(missing), str(missing / "p"),
                                                                         params=True))
    out["created"] = missing.is_dir() and (missing / "p").is_dir()
    engine.destroy()
    out["a file"] = _init_error(config(2, str(a_file)))
    out["under a file"] = _init_error(config(2, str(a_file / "sub")))
    out["under a file params"] = _init_error(config(3, str(good), str(a_file / "sub"), params=True))
    out["paths"] = {"a file": str(a_file), "under a file": str(a_file / "sub"), "good": str(good)}

    # Too little space: the swap files' size is known from an engine that fits.
    engine, *_ = zeroshard.initialize(model=make_model(0), config=config(2, str(good)))
    store = engine.optimizer.store
    out["opt need"] = ((1 if store.swap_masters else 0) + 2) * store.file_bytes
    engine.destroy()
    real_usage = shutil.disk_usage
    small = root / "small"
    small.mkdir()

    def usage(path: Any) -> Any:  # 12345 bytes free under ``small``, the truth elsewhere
        u = real_usage(path)
        return u._replace(free=12345) if Path(path) == small else u

    with _replaced(shutil, "disk_usage", usage):
        out["space"] = _init_error(config(2, str(small)))
        out["space params"] = _init_error(config(3, str(good), str(small), params=True))
    out["space path"] = str(small)
    # past the swap files: an optimizer the config cannot build (it left them until the process exited)
    for stage in (2, 3):
        out[f"bad optimizer {stage}"] = _init_error({**config(stage, str(good), str(good), params=stage == 3),
                                                     "optimizer": {"type": "NoSuchOptimizer"}})
    # nothing may be left behind by a failed initialize (the optimizer's directory included, when
    # the parameters' path is the one that fails)
    out["left"] = {p.name: _runs_left(p) for p in (good, small)}
    return out


def _train_until_error(engine: Any, arm: Callable[[], Any], steps: int = 4) -> dict[str, Any]:
    """Two good steps, then steps with the fault armed; what was raised, and where."""
    x, y = make_data(steps, MB)
    for step in range(steps):
        with arm() if step >= 2 else _nothing():
            try:
                loss = engine(x[step], y[step])
            except OffloadIOError as e:
                return {"where": "forward", "step": step + 1, "message": str(e), "errno": e.errno, "path": e.path}
            engine.backward(loss)
            try:
                engine.step()
            except OffloadIOError as e:
                return {"where": "step", "step": step + 1, "message": str(e), "errno": e.errno, "path": e.path}
    return {"where": None}


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _failing(name: str, code: int, only: str | None = None) -> Callable[[], Any]:
    """Arms ``os.<name>`` to fail with ``code`` (on files whose name is ``only``, when given)."""
    real = getattr(os, name)

    def fake(*args: Any) -> Any:
        if only is not None and not os.readlink(f"/proc/self/fd/{args[0]}").endswith(only):
            return real(*args)
        raise OSError(code, os.strerror(code))

    def arm() -> Any:
        assert getattr(os, name) is real
        return _replaced(os, name, fake)

    return arm


def _truncate(path_of: Callable[[], Path], settle: Callable[[], None]) -> Callable[[], Any]:
    @contextmanager
    def arm() -> Iterator[None]:
        # The previous step's last writes may still be running: one that ended after the cut would
        # extend the file again, and the bytes before it would read back as a hole of zeros, which
        # no reader can tell from data. The engine's pending writes end first, then the cut.
        settle()
        os.truncate(path_of(), 0)  # another process, a full disk's repair, a user: the bytes are gone
        yield

    return arm


def io_errors(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cases: list[tuple[str, int, bool, Callable[[Any], Callable[[], Any]]]] = [
        ("pwrite ENOSPC", 2, False, lambda e: _failing("pwrite", errno.ENOSPC)),
        ("preadv EIO", 2, False, lambda e: _failing("preadv", errno.EIO)),
        ("truncated", 2, False, lambda e: _truncate(lambda: e.optimizer.store.directory / "exp_avg.swp",
                                                    e.optimizer.store.settle)),
        # the parameter file's reads only: the forward also reads optimizer state, stepping the
        # sub-groups the last step left to it (SwappedStateStore.begin_step)
        ("params preadv EIO", 3, True, lambda e: _failing("preadv", errno.EIO, only="params.swp")),
    ]
    for name, stage, params, fault in cases:
        nvme = root / name.replace(" ", "_")
        nvme.mkdir()
        engine, *_ = zeroshard.initialize(model=make_model(0), config=config(stage, str(nvme), str(nvme),
                                                                             params=params))
        dirs = [engine.optimizer.store.directory]
        if params:
            dirs.append(engine.optimizer.shard.swap.directory)
        res = _train_until_error(engine, fault(engine))
        res["dirs"] = [str(d) for d in dirs]
        res["existed"] = all(d.is_dir() for d in dirs)
        engine.destroy()
        res["left"] = _runs_left(nvme)
        out[name] = res
    return out


def save_after_failed_write(root: Path) -> dict[str, Any]:
    """Writes fail during the third step and the save after it (the disk is full); the error must
    come from the step or the save, and no checkpoint of that state may be published."""
    nvme, ckpt = root / "nvme", root / "ckpt"
    nvme.mkdir()
    engine, *_ = zeroshard.initialize(model=make_model(0), config=config(2, str(nvme)))
    x, y = make_data(3, MB)
    for step in range(2):
        engine.backward(engine(x[step], y[step]))
        engine.step()
    out: dict[str, Any] = {"where": None}
    with _failing("pwrite", errno.ENOSPC)():
        engine.backward(engine(x[2], y[2]))
        try:
            engine.step()
            engine.save_checkpoint(str(ckpt), tag="after_step_3")
        except OffloadIOError as e:
            out = {"where": "step" if engine.global_steps < 3 else "save", "message": str(e), "errno": e.errno}
    out["published"] = sorted(p.name for p in ckpt.iterdir()) if ckpt.exists() else []
    out["latest"] = (ckpt / "latest").exists()
    engine.destroy()
    return out


def errors_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    base = Path(root)
    for d in ("config", "io", "save"):
        (base / d).mkdir()
    return {"config": config_errors(base / "config"), "io": io_errors(base / "io"),
            "save": save_after_failed_write(base / "save")}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("offload_errors")
    return run_distributed(errors_worker, 1, str(root), timeout=600)[0]


def test_bad_nvme_paths_are_config_errors_from_initialize(results: dict[str, Any]) -> None:
    r = results["config"]
    paths = r["paths"]
    assert r["no key"]["key"] == OPT_KEY, r["no key"]
    assert r["no key params"]["key"] == PARAM_KEY, r["no key params"]
    assert r["created"], "a missing nvme_path is created, as DeepSpeed creates it"
    for case, key, path, words in (("under a file", OPT_KEY, paths["under a file"], "cannot be created"),
                                   ("a file", OPT_KEY, paths["a file"], "is not a directory"),
                                   ("under a file params", PARAM_KEY, paths["under a file"], "cannot be created")):
        got = r[case]
        assert got["key"] == key, (case, got)
        assert path in got["message"] and words in got["message"], (case, got["message"])


def test_too_little_disk_space_names_bytes_needed_and_free(results: dict[str, Any]) -> None:
    r = results["config"]
    for case, key in (("space", OPT_KEY), ("space params", PARAM_KEY)):
        got = r[case]
        assert got["key"] == key, (case, got)
        assert r["space path"] in got["message"], got["message"]
        assert "12345 bytes" in got["message"] and "free" in got["message"], got["message"]
    assert f"need {r['opt need']} bytes" in r["space"]["message"], (r["opt need"], r["space"]["message"])


def test_failed_initialize_leaves_no_swap_directory(results: dict[str, Any]) -> None:
    """A bad optimizer path fails before any directory is made."""
    assert results["config"]["left"]["small"] == [], results["config"]["left"]


def test_initialize_failing_after_the_swap_files_removes_them(results: dict[str, Any]) -> None:
    for stage in (2, 3):
        assert "NoSuchOptimizer" in results["config"][f"bad optimizer {stage}"]["message"]
    assert results["config"]["left"]["good"] == [], results["config"]["left"]


def test_failed_parameter_path_leaves_no_optimizer_swap_directory(results: dict[str, Any]) -> None:
    """A bad parameter path, after the optimizer's swap files were made under a good one."""
    assert results["config"]["left"]["good"] == [], results["config"]["left"]


@pytest.mark.parametrize("case,errno_,file", [("pwrite ENOSPC", errno.ENOSPC, ".swp"),
                                               ("preadv EIO", errno.EIO, ".swp"),
                                               ("truncated", None, "exp_avg.swp")])
def test_io_error_in_the_step_is_offload_io_error(results: dict[str, Any], case: str, errno_: int | None,
                                                  file: str) -> None:
    r = results["io"][case]
    assert r["where"] == "step", f"{case}: no OffloadIOError from engine.step() ({r})"
    assert r["errno"] == errno_, r
    assert r["path"].startswith(r["dirs"][0]) and r["path"].endswith(file), r
    named = re.search(r"optimizer step (\d+)", r["message"])
    assert named and r["path"] in r["message"], r["message"]
    if case == "pwrite ENOSPC":
        # Armed from the third step's forward. A step's last writes run on during the next forward
        # and backward, and a write error surfaces from the next step() (first thing it does): so
        # either step 2's last writes failed (raised by step 3) or step 3's (raised by step 4).
        assert (r["step"], int(named[1])) in ((3, 2), (4, 3)), (r["step"], r["message"])
    else:
        assert r["step"] == 3 and int(named[1]) == 3, r  # a failed read: in the step that reads
    if case == "truncated":
        assert "short read" in r["message"], r["message"]
    assert r["existed"] and r["left"] == [], f"{case}: swap directory not removed by destroy(): {r['left']}"


def test_failed_write_is_never_saved(results: dict[str, Any]) -> None:
    """A step's last writes end after it returns; a save right after reads the files only once they
    have ended, so their error stops the save instead of a checkpoint holding the stale state."""
    r = results["save"]
    assert r["where"] in ("step", "save") and r["errno"] == errno.ENOSPC, r
    assert "No space left" in r["message"] and ".swp" in r["message"], r["message"]
    assert not r["latest"] and "after_step_3" not in r["published"], r


def test_io_error_reading_parameters_surfaces_in_forward(results: dict[str, Any]) -> None:
    r = results["io"]["params preadv EIO"]
    assert r["where"] == "forward" and r["step"] == 3, r
    assert r["errno"] == errno.EIO and r["path"].endswith("params.swp"), r
    assert r["path"] in r["message"] and "ZeRO-3 parameter shard" in r["message"], r["message"]
    assert r["existed"] and r["left"] == [], f"swap directories not removed by destroy(): {r['left']}"


def test_io_error_reading_parameters_names_the_step(results: dict[str, Any]) -> None:
    message = results["io"]["params preadv EIO"]["message"]
    assert re.search(r"ZeRO-3 parameter shard of unit \d+, step \d+", message), message


_EXIT_SCRIPT = """
import os, sys
import torch.distributed as dist
sys.path.insert(0, {tests!r})
from models import make_data, make_model
import zeroshard
dist.init_process_group("gloo", init_method="file://" + {store!r}, rank=0, world_size=1)
cfg = {{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {{"stage": 2,
       "offload_optimizer": {{"device": "nvme", "nvme_path": {nvme!r}}}}},
       "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-2}}}}}}
engine, *_ = zeroshard.initialize(model=make_model(0), config=cfg)
x, y = make_data(1, 4)
engine.backward(engine(x[0], y[0]))
engine.step()
d = engine.optimizer.store.directory
print(d, d.is_dir(), sorted(p.name for p in d.iterdir()), flush=True)
if {crash!r}:
    os._exit(0)
dist.destroy_process_group()  # the script's own group (the engine is what is left undestroyed)
open({done!r}, "w").close()
"""


@pytest.mark.parametrize("crash", [False, True])
def test_interpreter_exit_removes_swap_directory(tmp_path: Path, crash: bool) -> None:
    """No ``destroy()``: a clean exit removes the swap directory; ``os._exit`` (no atexit) leaves it."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    done = tmp_path / "out.rank0.done"
    script = _EXIT_SCRIPT.format(tests=str(Path(__file__).resolve().parents[1]), store=str(tmp_path / "store"),
                                 nvme=str(nvme), crash=crash, done=str(done))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    # gloo now and then aborts a process in torch's teardown after the script has finished
    # (tests/teardown.py; seen here once in CI): the atexit hook under test has run by then
    aborted = proc.returncode == -6 and died_in_teardown("the interpreter-exit script", proc.stderr, [done],
                                                         ABORT_MARKS[:1])
    assert proc.returncode == 0 or aborted, proc.stderr[-3000:]
    directory, existed, files = proc.stdout.strip().split(" ", 2)
    assert existed == "True" and "exp_avg.swp" in files, proc.stdout
    assert Path(directory).is_relative_to(nvme)
    if crash:
        assert Path(directory).is_dir(), "the directory vanished without the atexit hook: the check proves nothing"
    else:
        assert _runs_left(nvme) == [], f"swap directory left after a clean exit: {os.listdir(nvme)}"


def _undestroyed_worker(rank: int, world: int, nvme: str) -> str:
    """An NVMe-offloaded stage-3 engine (optimizer state and parameters in swap files) left without
    ``destroy()`` in a multiprocessing child, as the Hugging Face Trainer leaves it."""
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
                                 "offload_param": {"device": "nvme", "nvme_path": nvme}}}
    engine, *_ = zeroshard.initialize(model=make_model(0), config=cfg)
    x, y = make_data(1, 8)
    engine.backward(engine(x[0, rank * 4 : rank * 4 + 4], y[0, rank * 4 : rank * 4 + 4]))
    engine.step()
    assert any(Path(nvme).iterdir())
    return str(engine.optimizer.store.directory)


def test_multiprocessing_child_exit_removes_swap_directories(tmp_path: Path) -> None:
    """A multiprocessing child ends in ``os._exit`` without running ``atexit`` hooks: the swap
    directories go with its ``multiprocessing`` finalizers (they were left behind before)."""
    made = run_distributed(_undestroyed_worker, 2, str(tmp_path))
    assert all(made) and not any(tmp_path.iterdir()), f"left behind: {list(tmp_path.iterdir())}"


def sub_group_warning_worker(rank: int, world: int, nvme: str, sub_group: int | None) -> dict[str, Any]:
    import logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("zeroshard").addHandler(handler)
    cfg = config(2, nvme)
    del cfg["zero_optimization"]["sub_group_size"], cfg["zero_optimization"]["reduce_bucket_size"]
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
    if sub_group is not None:
        cfg["zero_optimization"]["sub_group_size"] = sub_group
    import torch

    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(8)))  # 1.05M elements a rank
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    store = engine.optimizer.store
    out = {"warnings": [m for m in records if "nothing is saved" in m], "subgroups": len(store.subgroups),
           "buffered": len(store.slots) * max(sg.numel for sg in store.subgroups),
           "shard": sum(sg.numel for sg in store.subgroups)}
    engine.destroy()
    return out


@pytest.mark.parametrize("sub_group", [None, 1_000_000_000])
def test_a_sub_group_size_that_saves_nothing_warns_once(tmp_path: Path, sub_group: int | None) -> None:
    """DeepSpeed's 1e9 written out: one sub-group of the whole shard, buffers as large as the state
    in memory, and rank 0 says so once with both figures. Left unset: sub-groups are chosen and
    nothing is said."""
    r0, r1 = run_distributed(sub_group_warning_worker, 2, str(tmp_path), sub_group)
    if sub_group is None:
        assert r0["warnings"] == [] and r0["subgroups"] > 1, r0
        assert r0["buffered"] <= r0["shard"] // 4, r0  # the quarter the choice promises
    else:
        assert r0["subgroups"] == 1 and r0["buffered"] >= r0["shard"], r0
        assert len(r0["warnings"]) == 1 and "sub_group_size 1000000000" in r0["warnings"][0], r0["warnings"]
        assert "MiB" in r0["warnings"][0]
    assert r1["warnings"] == []  # rank 0 speaks for all
