"""Fuzzed command lines: ``zeroshard``, ``zeroshard convert`` and ``zeroshard launch``'s translation to
torchrun (the launch is never started) get argument lists drawn by hypothesis from their options,
good and bad values, paths and junk. Each either succeeds or exits with code 2 and an ``error:``
message on stderr; never a traceback. What ``launch`` accepts, torchrun's own parser accepts too.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeroshard.cli import launch
from zeroshard.cli.main import COMMANDS, main

SCALE = float(os.environ.get("ZEROSHARD_FUZZ_SCALE", "1"))
FUZZ = settings(max_examples=int(200 * SCALE), deadline=None,
                # CI (CI=true) replays the same examples every run; elsewhere each run explores anew
                derandomize=bool(os.environ.get("CI")),
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

junk = st.text(st.characters(exclude_characters="\x00", exclude_categories=("Cs",)), max_size=10)
names = st.text(st.characters(exclude_characters="\x00/", exclude_categories=("Cs",)), max_size=10)
"""Junk for paths that ``convert`` may write to: relative names only, inside the scratch directory."""
numbers = st.sampled_from(["0", "1", "2", "-1", "65536", "65535", "1.5", "1e3", "1:2", "3:1", "0:4", "auto", "cpu",
                           "gpu", "99999999999999999999", ""])


@pytest.fixture(scope="module", autouse=True)
def scratch_cwd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Run in a scratch directory: ``convert`` writes wherever a relative output path points."""
    old = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(old)


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A valid (DeepSpeed-format) checkpoint, a script, a plain file and a directory, by role."""
    root = tmp_path_factory.mktemp("cli")
    tag = root / "ckpt" / "global_step1"
    tag.mkdir(parents=True)
    w = torch.arange(6.0)
    torch.save({"module": {"w": w}, "param_shapes": [{"w": torch.Size([6])}], "buffer_names": []},
               tag / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {"zero_stage": 1, "partition_count": [1],
                                         "single_partition_of_fp32_groups": [w.clone()]}},
               tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (root / "ckpt" / "latest").write_text("global_step1")
    (root / "train.py").write_text("print('hi')\n")
    (root / "notes.txt").write_text("not a checkpoint\n")
    return {"ckpt": str(root / "ckpt"), "tag_dir": str(tag), "script": str(root / "train.py"),
            "file": str(root / "notes.txt"), "dir": str(root), "missing": str(root / "missing"),
            "out": str(root / "out"), "out_file": str(root / "out" / "model.safetensors")}


@contextlib.contextmanager
def captured() -> Iterator[io.StringIO]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        yield err


def exit_code(fn: Any, *args: Any) -> tuple[int, str, Any]:
    """Run ``fn(*args)``: ``(exit code, stderr, return value)``; exceptions other than SystemExit fail."""
    with captured() as err:
        try:
            value = fn(*args)
            code = value if isinstance(value, int) else 0
        except SystemExit as e:
            value, code = None, e.code if isinstance(e.code, int) else 1
    return code, err.getvalue(), value


def check_usage_error(code: int, err: str) -> None:
    assert code == 2, f"exit code {code}: {err}"
    assert "error:" in err and "Traceback" not in err, err


# ------------------------------------------------------------------------------------------ convert


@st.composite
def convert_argv(draw: st.DrawFn, paths: dict[str, str]) -> list[str]:
    path = st.sampled_from(sorted(paths.values())) | names
    argv = [draw(path), draw(path)][: draw(st.integers(0, 2))]
    for _ in range(draw(st.integers(0, 4))):
        option = draw(st.sampled_from(["--tag", "--dtype", "--max-shard-size", "-q", "--quiet", "--bogus", "--",
                                       "-x", "--max-shard", "--dtype=bf16"]))
        argv.append(option)
        if option in ("--tag", "--dtype", "--max-shard-size", "--max-shard") and draw(st.booleans()):
            argv.append(draw(st.sampled_from(["fp32", "bf16", "fp16", "fp64", "5GB", "500MiB", "1", "0", "-3",
                                              "1.5kb", "global_step1", "global_step9", "../x", ".hidden"]) | names))
    return draw(st.permutations(argv))


@FUZZ
@given(st.data())
def test_convert_arguments(paths: dict[str, str], data: st.DataObject) -> None:
    argv = data.draw(convert_argv(paths))
    code, err, _ = exit_code(main, ["convert", *argv])
    if code != 0:
        check_usage_error(code, err)


# ------------------------------------------------------------------------------------------ launch

OWN = ["--nproc_per_node", "--nproc-per-node", "--num_gpus", "--nnodes", "--num_nodes", "--node_rank",
       "--master_addr", "--master_port", "--master-port"]
PASSED = [s for action in launch._torchrun_actions() for s in action.option_strings]


@st.composite
def launch_argv(draw: st.DrawFn, paths: dict[str, str]) -> list[str]:
    argv: list[str] = []
    for _ in range(draw(st.integers(0, 5))):
        option = draw(st.sampled_from(OWN + PASSED + ["--bogus", "-h2", "--nproc", "--"]))
        argv.append(option)
        if draw(st.integers(0, 3)):
            argv.append(draw(numbers | st.sampled_from(["c10d", "static", "h:29400", "spawn", "fork", "node", "0,1",
                                                          "localhost"]) | junk))
    if draw(st.integers(0, 4)):
        argv.append(draw(st.sampled_from([paths["script"], paths["missing"], paths["dir"], "pkg.train", "python"])
                         | junk))
        argv += draw(st.lists(junk | numbers | st.sampled_from(OWN), max_size=3))
    return argv


@FUZZ
@given(st.data())
def test_launch_arguments(paths: dict[str, str], data: st.DataObject) -> None:
    from torch.distributed.run import parse_args

    argv = data.draw(launch_argv(paths))
    if "-h" in argv or "--help" in argv:  # help exits 0: not what this test is about
        return
    code, err, out = exit_code(launch.build_torchrun_argv, argv)
    if code != 0:
        check_usage_error(code, err)
        return
    code, err, parsed = exit_code(parse_args, out)
    assert code == 0, f"zeroshard launch {argv} -> torchrun {out}, which torchrun rejects: {err}"
    if "--" not in argv:  # argparse (ours and torchrun's) drops a bare "--" among the script's arguments
        assert parsed.training_script == argv[len(argv) - len(parsed.training_script_args) - 1]


@pytest.mark.parametrize("script_arg", ["--max", "--log", "--nproc", "--local"])
def test_script_args_that_abbreviate_torchrun_options(paths: dict[str, str], script_arg: str) -> None:
    from torch.distributed.run import parse_args

    out = launch.build_torchrun_argv([paths["script"], script_arg, "5"])
    code, err, parsed = exit_code(parse_args, out)
    assert code == 0, err
    assert parsed.training_script_args == [script_arg, "5"]


# ------------------------------------------------------------------------------------------ top level


@FUZZ
@given(st.lists(junk | st.sampled_from(["--version", "-h", "--help", "-v", "--", "lanch", "convrt", "launch "]),
                min_size=0, max_size=3))
def test_top_level_arguments(argv: list[str]) -> None:
    if any(token in COMMANDS for token in argv):  # a real command would run
        return
    code, err, _ = exit_code(main, argv)
    if code != 0:
        check_usage_error(code, err)
