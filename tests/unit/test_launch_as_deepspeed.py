"""``zeroshard launch --as-deepspeed`` / ``--shadow-deepspeed``: the workers run the script through
``python -m zeroshard.deepspeed.imports``, which enables the layer before the script imports anything."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zeroshard.cli.launch import build_torchrun_argv

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return str(path)


def test_argv_runs_the_script_through_the_bootstrap(script: str) -> None:
    argv = build_torchrun_argv(["--nproc_per_node", "2", "--as-deepspeed", script, "--steps", "3"])
    assert argv == ["--nproc_per_node", "2", "--standalone", "--module", "--", "zeroshard.deepspeed.imports",
                    script, "--steps", "3"]
    argv = build_torchrun_argv(["--shadow-deepspeed", script])
    assert argv[argv.index("--") + 1:] == ["zeroshard.deepspeed.imports", "--shadow", script]
    # a module stays a module: the bootstrap runs it with -m
    argv = build_torchrun_argv(["--as_deepspeed", "-m", "pkg.train", "x"])
    assert argv[argv.index("--") - 1:] == ["--module", "--", "zeroshard.deepspeed.imports", "-m", "pkg.train", "x"]
    assert argv.count("--module") == 1
    # without the switch nothing changes
    assert build_torchrun_argv([script, "a"])[-3:] == ["--", script, "a"]


def test_refused_with_no_python(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_torchrun_argv(["--as-deepspeed", "--no_python", script])
    assert info.value.code == 2
    assert "--as-deepspeed: not allowed together with --no_python" in capsys.readouterr().err


def test_launched_script_imports_zeroshard_as_deepspeed(tmp_path: Path) -> None:
    script = tmp_path / "check.py"
    script.write_text(
        "import sys, importlib.metadata\n"
        "import deepspeed\n"
        "import zeroshard\n"
        "assert deepspeed.initialize is zeroshard.initialize, deepspeed\n"
        "assert '+zeroshard' in importlib.metadata.version('deepspeed')\n"
        "assert sys.argv[1:] == ['--flag', 'v'], sys.argv\n"
        "open(sys.argv[0] + '.ok', 'w').write('ok')\n")
    switch = "--shadow-deepspeed" if importlib.util.find_spec("deepspeed") else "--as-deepspeed"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "zeroshard.cli.main", "launch", "--nproc_per_node", "1", switch,
                           str(script), "--flag", "v"], capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "check.py.ok").read_text() == "ok"


def test_refused_up_front_when_the_real_deepspeed_is_installed(script: str, capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused by the launcher, naming --shadow-deepspeed, instead of by every worker with a traceback."""
    from zeroshard.cli.launch import main

    real = importlib.util.spec_from_loader("deepspeed", loader=None, origin="/site-packages/deepspeed/__init__.py")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: real if name == "deepspeed" else None)
    with pytest.raises(SystemExit) as info:
        main(["--nproc_per_node", "2", "--as-deepspeed", script])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "/site-packages/deepspeed/__init__.py" in err and "--shadow-deepspeed" in err
    assert main(["--dry-run", "--shadow-deepspeed", script]) == 0  # the switch that hides it is accepted
