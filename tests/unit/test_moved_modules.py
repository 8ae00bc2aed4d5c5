"""Old module paths from the documentation keep working for a release, with a deprecation warning
naming the new path (docs/deprecations.md): until 2026-12-06 the docs said
``python -m zeroshard.compat.deepspeed train.py`` and ``zeroshard.compat.deepspeed.enable()``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _python(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC}
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_old_import_layer_path_is_the_same_module_and_warns_once_current_spellings_never(tmp_path: Path) -> None:
    code = (
        # current spellings (attributes of zeroshard) import as modules, without a warning
        "import zeroshard, zeroshard.comm, zeroshard.utils.zero_to_fp32\n"
        "from zeroshard.checkpointing import checkpoint\n"
        "import zeroshard.deepspeed.comm as comm, zeroshard.deepspeed.utils as utils\n"
        "assert zeroshard.comm is comm and zeroshard.utils is utils\n"
        "assert utils.__spec__.name == 'zeroshard.deepspeed.utils'\n"
        "import zeroshard.compat.deepspeed as old\n"
        "import zeroshard.compat.deepspeed\n"
        "from zeroshard.compat.deepspeed import enable\n"
        "import zeroshard.deepspeed.imports as new\n"
        "assert old is new and enable is new.enable\n"
        "old.enable(shadow=True)\n"
        "assert new.is_enabled()\n"
        "import deepspeed, zeroshard\n"
        "assert deepspeed.initialize is zeroshard.initialize\n"
        "print('OK')\n"
    )
    out = _python("-c", code, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "OK"
    warnings = [line for line in out.stderr.splitlines() if "ZeroshardDeprecationWarning" in line]
    assert len(warnings) == 1, out.stderr  # shown without -W, and once
    assert "'zeroshard.compat.deepspeed' is deprecated" in warnings[0]
    assert "use 'zeroshard.deepspeed.imports'" in warnings[0]


def test_old_path_runs_a_script_with_python_m(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import sys, deepspeed, zeroshard\n"
                      "assert deepspeed.initialize is zeroshard.initialize\n"
                      "print('ran with', sys.argv[1:])\n")
    out = _python("-m", "zeroshard.compat.deepspeed", "--shadow", str(script), "--lr", "3", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ran with ['--lr', '3']"
    assert "use 'zeroshard.deepspeed.imports'" in out.stderr and "DeprecationWarning" in out.stderr


def test_the_table_points_at_modules_that_exist() -> None:
    import importlib.util

    from zeroshard.moved_modules import MOVED, ZeroshardDeprecationWarning, new_name

    for old, (new, _) in MOVED.items():
        assert importlib.util.find_spec(new) is not None, (old, new)
    assert new_name("zeroshard.compat.ds_moe.layer") == ("zeroshard.deepspeed.moe.layer", True)
    assert new_name("zeroshard.core") is None
    with pytest.warns(ZeroshardDeprecationWarning, match="zeroshard.deepspeed.op_builder"):
        importlib.import_module("zeroshard.compat.ds_op_builder")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("zeroshard.compat.not_a_module")
