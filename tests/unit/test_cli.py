"""The ``zeroshard`` command line: dispatch, ``--version``, and ``launch``'s translation to torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zeroshard.cli import launch
from zeroshard.cli.main import COMMANDS, main

SRC = Path(__file__).resolve().parents[2] / "src"


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zeroshard.cli.main", *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return str(path)


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``zeroshard launch ARGV``, expecting a usage error; return its message."""
    with pytest.raises(SystemExit) as info:
        launch.build_torchrun_argv(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


# ---------------------------------------------------------------- translation


def test_single_node_defaults_to_standalone_rendezvous(script: str) -> None:
    assert launch.build_torchrun_argv(["--nproc_per_node", "2", script]) == [
        "--nproc_per_node", "2", "--standalone", "--", script,
    ]


@pytest.mark.parametrize("flag", ["--nproc_per_node", "--nproc-per-node", "--num_gpus", "--num-gpus"])
def test_nproc_aliases(script: str, flag: str) -> None:
    argv = launch.build_torchrun_argv([flag, "4", script])
    assert argv[:2] == ["--nproc_per_node", "4"]


@pytest.mark.parametrize("devices", [0, 1, 4])
def test_no_process_count_starts_one_per_accelerator(script: str, devices: int, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """As ``deepspeed script.py``: every visible accelerator (torchrun alone would start one process);
    without any, torchrun's default of one."""
    import torch

    monkeypatch.setattr(torch.accelerator, "device_count", lambda: devices)
    argv = launch.build_torchrun_argv([script])
    if devices:
        assert argv[:2] == ["--nproc_per_node", str(devices)]
        assert f"{devices} processes, one per visible accelerator" in capsys.readouterr().err
    else:
        assert "--nproc_per_node" not in argv
    assert launch.build_torchrun_argv(["--num_gpus", "2", script])[:2] == ["--nproc_per_node", "2"]


@pytest.mark.parametrize("option", ["--bind_cores_to_rank", "--bind_core_list 0-7", "--autotuning tune",
                                    "--enable_each_rank_log logs", "--save_pid"])
def test_deepspeed_launcher_options_zeroshard_lacks_are_named(script: str, option: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Both of DeepSpeed-Chat's run scripts pass --bind_cores_to_rank: named, not argparse's
    generic "unrecognized arguments"."""
    err = _error(capsys, [*option.split(), script])
    name = option.split()[0]
    assert f"argument {name}: DeepSpeed's launcher option is not supported by zeroshard launch: " in err, err


def test_nproc_keywords_pass_through(script: str) -> None:
    argv = launch.build_torchrun_argv(["--nproc_per_node", "auto", script])
    assert argv[:2] == ["--nproc_per_node", "auto"]


def test_script_args_are_never_eaten(script: str) -> None:
    argv = launch.build_torchrun_argv(
        ["--num_gpus", "2", script, "--nproc_per_node", "8", "--master_port", "1", "-m", "x", "--", "--help"]
    )
    assert argv == [
        "--nproc_per_node", "2", "--standalone", "--",
        script, "--nproc_per_node", "8", "--master_port", "1", "-m", "x", "--", "--help",
    ]


def test_master_addr_gets_deepspeed_default_port(script: str) -> None:
    argv = launch.build_torchrun_argv(["--master_addr", "10.0.0.1", script])
    assert argv == ["--master_addr", "10.0.0.1", "--master_port", "29500", "--", script]
    assert launch.DEFAULT_MASTER_PORT == 29500


def test_master_port_alone_is_kept(script: str) -> None:
    assert launch.build_torchrun_argv(["--master_port", "1234", script]) == ["--master_port", "1234", "--", script]


def test_multi_node_static(script: str) -> None:
    argv = launch.build_torchrun_argv(
        ["--nnodes", "2", "--node_rank", "1", "--nproc_per_node", "8", "--master_addr", "host0",
         "--master_port", "6000", script, "--lr", "3e-4"]
    )
    assert argv == [
        "--nproc_per_node", "8", "--nnodes", "2", "--node_rank", "1",
        "--master_addr", "host0", "--master_port", "6000", "--", script, "--lr", "3e-4",
    ]


def test_num_nodes_alias(script: str) -> None:
    argv = launch.build_torchrun_argv(["--num_nodes", "2", "--master_addr", "h", script])
    assert argv[:2] == ["--nnodes", "2"]


def test_rendezvous_options_pass_through(script: str) -> None:
    argv = launch.build_torchrun_argv(
        ["--nnodes", "1:4", "--nproc_per_node", "2", "--rdzv-backend", "c10d", "--rdzv_endpoint", "h:29400",
         "--rdzv_id", "job7", "--rdzv_conf", "timeout=60", "--max_restarts", "3", "--monitor_interval", "0.5",
         "--log_dir", "/tmp/logs", script]
    )
    assert "--standalone" not in argv and "--master_port" not in argv
    assert argv[:4] == ["--nproc_per_node", "2", "--nnodes", "1:4"]
    assert argv[-2:] == ["--", script]
    pairs = dict(zip(argv[4:-2:2], argv[5:-2:2], strict=True))
    assert pairs == {
        "--rdzv_backend": "c10d", "--rdzv_endpoint": "h:29400", "--rdzv_id": "job7",
        "--rdzv_conf": "timeout=60", "--max_restarts": "3", "--monitor_interval": "0.5",
        "--log_dir": "/tmp/logs",
    }


def test_explicit_standalone_is_not_doubled(script: str) -> None:
    assert launch.build_torchrun_argv(["--standalone", script]) == ["--standalone", "--", script]


def test_module_mode_skips_file_check() -> None:
    argv = launch.build_torchrun_argv(["-m", "mypkg.train", "--steps", "3"])
    assert argv == ["--standalone", "--module", "--", "mypkg.train", "--steps", "3"]


def test_translated_argv_is_accepted_by_torchrun(script: str) -> None:
    from torch.distributed.run import parse_args

    argv = launch.build_torchrun_argv(
        ["--num_gpus", "3", "--max_restarts", "2", "--master_addr", "h", script, "--nproc_per_node", "9"]
    )
    parsed = parse_args(argv)
    assert parsed.nproc_per_node == "3"
    assert parsed.max_restarts == 2
    assert parsed.master_addr == "h" and parsed.master_port == 29500
    assert parsed.training_script == script
    assert parsed.training_script_args == ["--nproc_per_node", "9"]


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_bad_nproc(capsys: pytest.CaptureFixture[str], script: str, value: str) -> None:
    err = _error(capsys, ["--nproc_per_node", value, script])
    assert "--nproc_per_node" in err and repr(value) in err


def test_missing_script(capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(capsys, ["--nproc_per_node", "2"])
    assert "required" in err and "script" in err and "script_args" not in err


def test_nonexistent_script(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.py")
    err = _error(capsys, [missing])
    assert "argument script" in err and missing in err


def test_directory_as_script(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert "argument script" in _error(capsys, [str(tmp_path)])


@pytest.mark.parametrize("value", ["0", "x", "3:2", "1:2:3"])
def test_bad_nnodes(capsys: pytest.CaptureFixture[str], script: str, value: str) -> None:
    assert "--nnodes" in _error(capsys, ["--nnodes", value, "--master_addr", "h", script])


def test_node_rank_out_of_range(capsys: pytest.CaptureFixture[str], script: str) -> None:
    err = _error(capsys, ["--nnodes", "2", "--node_rank", "2", "--master_addr", "h", script])
    assert "--node_rank" in err


@pytest.mark.parametrize("value", ["0", "70000", "http"])
def test_bad_master_port(capsys: pytest.CaptureFixture[str], script: str, value: str) -> None:
    assert "--master_port" in _error(capsys, ["--master_port", value, script])


def test_multi_node_needs_master_addr(capsys: pytest.CaptureFixture[str], script: str) -> None:
    assert "--master_addr" in _error(capsys, ["--nnodes", "2", script])


def test_module_and_no_python_conflict(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--module" in _error(capsys, ["--module", "--no_python", "pkg"])


def test_unknown_option_before_script(capsys: pytest.CaptureFixture[str], script: str) -> None:
    assert "--bogus" in _error(capsys, ["--bogus", script])


def test_abbreviations_are_not_guessed(capsys: pytest.CaptureFixture[str], script: str) -> None:
    assert "--nproc" in _error(capsys, ["--nproc", "2", script])


def test_worker_environment_as_deepspeeds_launcher(script: str, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """LOCAL_SIZE, CROSS_RANK and CROSS_SIZE as DeepSpeed's launcher sets them; OMP_NUM_THREADS the
    cores divided among the ranks (torchrun's 1 starves CPU work) unless the user set it."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)

    def env_of(argv: list[str]) -> dict[str, str]:
        assert launch.main(["--dry-run", *argv]) == 0
        line = capsys.readouterr().out.strip()
        return dict(word.split("=", 1) for word in line.split(" ") if "=" in word and not word.startswith("-"))

    assert env_of(["--num_gpus", "4", script]) == {"LOCAL_SIZE": "4", "CROSS_RANK": "0", "CROSS_SIZE": "1",
                                                   "OMP_NUM_THREADS": "4"}
    multi = env_of(["--nnodes", "3", "--node_rank", "2", "--master_addr", "h0", "--nproc_per_node", "2", script])
    assert multi == {"LOCAL_SIZE": "2", "CROSS_RANK": "2", "CROSS_SIZE": "3", "OMP_NUM_THREADS": "8"}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert "OMP_NUM_THREADS" not in env_of(["--num_gpus", "4", script])  # the user's value reaches the workers


def test_deepspeeds_log_level_and_quiet(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    monkeypatch.delenv("LOGLEVEL", raising=False)
    for argv, level in ((["--log_level", "warning"], logging.WARNING), (["-q"], logging.ERROR),
                        (["--quiet"], logging.ERROR), (["--log_level", "info"], logging.INFO)):
        assert launch.main(["--dry-run", *argv, script]) == 0
        assert logging.getLogger("torch.distributed").level == level, argv
        assert logging.getLogger("zeroshard").level == level, argv
    # unset: the launcher's own messages from info up, torchrun's internals from warning up (or LOGLEVEL's)
    for loglevel, torchrun_level in ((None, logging.WARNING), ("INFO", logging.INFO), ("nonsense", logging.WARNING)):
        if loglevel is not None:
            monkeypatch.setenv("LOGLEVEL", loglevel)
        assert launch.main(["--dry-run", script]) == 0
        assert logging.getLogger("torch.distributed").level == torchrun_level, loglevel
        assert logging.getLogger("zeroshard").level == logging.INFO
    logging.getLogger("torch.distributed").setLevel(logging.NOTSET)
    logging.getLogger("zeroshard").setLevel(logging.NOTSET)


def test_errors_exit_2_without_traceback(tmp_path: Path) -> None:
    proc = _cli("launch", "--nproc_per_node", "0", str(tmp_path / "x.py"))
    assert proc.returncode == 2
    assert "--nproc_per_node" in proc.stderr and "Traceback" not in proc.stderr
    proc = _cli("launch", str(tmp_path / "missing.py"))
    assert proc.returncode == 2
    assert "argument script" in proc.stderr and "missing.py" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- top level


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("zeroshard ") and out.strip() != "zeroshard"


def test_help_lists_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


def test_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["lanch"])
    assert info.value.code == 2
    assert "lanch" in capsys.readouterr().err


def test_no_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


def test_dispatch_passes_remaining_args(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["launch", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: zeroshard launch") and "--rdzv_backend" in out


def test_every_command_module_has_main() -> None:
    import importlib

    for module_name, _ in COMMANDS.values():
        assert callable(importlib.import_module(module_name).main)


def test_cli_import_does_not_import_torch() -> None:
    code = (
        "import sys, zeroshard\n"
        "before = 'torch' in sys.modules\n"
        "import zeroshard.cli.main\n"
        "assert before or 'torch' not in sys.modules, 'zeroshard.cli.main imported torch'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert proc.returncode == 0, proc.stderr


def test_version_subprocess() -> None:
    proc = _cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("zeroshard ")


# ---------------------------------------------------------------- estimate, report


def test_estimate_help_subprocess() -> None:
    proc = _cli("estimate", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: zeroshard estimate")
    assert all(flag in proc.stdout for flag in ("--params", "--gpus", "--gpu-memory", "--cpu-memory", "--seq-len"))


def test_estimate_subprocess() -> None:
    proc = _cli("estimate", "--params", "7e9", "--gpus", "8")
    assert proc.returncode == 0, proc.stderr
    assert "| 3     | none" in proc.stdout and "| 3     | optimizer+params->nvme" in proc.stdout


def test_report_subprocess() -> None:
    proc = _cli("report")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("zeroshard report")
    for text in ("torch ", "NCCL", "gloo", "pinned memory", "async I/O", "fast CPU optimizer", "transformers"):
        assert text in proc.stdout, text
    assert "\033[" not in proc.stdout  # not a terminal: no colours
