"""DeepSpeed's launcher inputs in ``zeroshard launch``: hostfiles, ``--include``/``--exclude``,
``--num_nodes``/``--num_gpus`` on a hostfile, ``.deepspeed_env``, the per-host commands
(``--dry-run``) and when ``--local_rank`` is passed. Single process; nothing is launched.
Where DeepSpeed 0.19 is installed, its own functions are the oracle for valid inputs."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroshard.cli import launch, multinode
from zeroshard.cli.hostfile import (
    ResourceError,
    filter_resources,
    limit_resources,
    parse_hostfile,
    parse_node_specs,
    read_hostfile,
    visible_devices,
)

# ---------------------------------------------------------------- hostfile


def test_hostfile_format_comments_and_extra_fields() -> None:
    text = "# the cluster\n\nworker-0 slots=4\n  worker-1   slots=2 max_slots=8  # spare\n10.0.0.7 slots=1\n"
    assert parse_hostfile(text.splitlines()) == {"worker-0": 4, "worker-1": 2, "10.0.0.7": 1}
    assert list(parse_hostfile(text.splitlines())) == ["worker-0", "worker-1", "10.0.0.7"]  # file order


@pytest.mark.parametrize("line", ["worker-0", "worker-0 slots=", "worker-0 slots=x", "worker-0 slot=4",
                                  "slots=4", "worker-0 slots=4 junk", "worker-0 4"])
def test_bad_hostfile_line_names_file_and_line(line: str) -> None:
    with pytest.raises(ResourceError, match=re.escape("hosts.txt:2: expected 'HOST slots=N'")) as info:
        parse_hostfile(["a slots=1", line], "hosts.txt")
    assert repr(line.strip()) in str(info.value)


def test_duplicate_host_names_both_lines() -> None:
    with pytest.raises(ResourceError, match=r"hosts.txt:4: host 'a' is listed twice \(first on line 1\)"):
        parse_hostfile(["a slots=1", "b slots=1", "# c", "a slots=2"], "hosts.txt")


def test_zero_slots_and_empty_file() -> None:
    with pytest.raises(ResourceError, match=r"h:1: host 'a' has slots=0"):
        parse_hostfile(["a slots=0"], "h")
    with pytest.raises(ResourceError, match=r"h: no hosts"):
        parse_hostfile(["# nothing", ""], "h")


def test_read_hostfile_names_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ResourceError, match=re.escape(f"cannot read hostfile {str(tmp_path / 'nope')!r}")):
        read_hostfile(tmp_path / "nope")
    (tmp_path / "hf").write_text("w0 slots=2\nw1 slots=2\n")
    assert read_hostfile(tmp_path / "hf") == {"w0": 2, "w1": 2}


# ---------------------------------------------------------------- include / exclude

POOL = {"worker-0": 4, "worker-1": 4, "worker-2": 2}


@pytest.mark.parametrize(("include", "exclude", "expected"), [
    ("", "", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}),
    ("worker-0@worker-1:0,2", "", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 2]}),  # DeepSpeed's help text
    ("", "worker-1:0", {"worker-0": [0, 1, 2, 3], "worker-1": [1, 2, 3], "worker-2": [0, 1]}),
    ("worker-2@worker-0:3", "", {"worker-0": [3], "worker-2": [0, 1]}),  # hostfile order, not the option's
    ("worker-1:2,0,2", "", {"worker-1": [0, 2]}),  # sorted, duplicates dropped
    ("worker-0@worker-0:1", "", {"worker-0": [1]}),  # DeepSpeed merges mentions: the slot list wins
    ("", "worker-0@worker-2:0,1", {"worker-1": [0, 1, 2, 3]}),  # hosts left without slots are dropped
])
def test_filters(include: str, exclude: str, expected: dict) -> None:
    result = filter_resources(POOL, include, exclude)
    assert result == expected and list(result) == list(expected)


@pytest.mark.parametrize(("include", "exclude", "message"), [
    ("worker-0", "worker-1", "--include and --exclude: not allowed together"),
    ("worker-9", "", "--include: host 'worker-9' is not in the hostfile (worker-0, worker-1, worker-2)"),
    ("", "worker-2:2", "--exclude: host 'worker-2' has no slot 2 (slots 0..1)"),
    ("worker-0:x", "", "--include: slot 'x' of host 'worker-0' is not a non-negative integer"),
    ("worker-0:", "", "--include: slot '' of host 'worker-0'"),
    ("worker-0:1:2", "", "--include: slot '1:2' of host 'worker-0'"),
    ("worker-0@", "", "--include: empty host name in 'worker-0@'"),
    ("", ":1", "--exclude: empty host name"),
])
def test_bad_filters_name_the_option(include: str, exclude: str, message: str) -> None:
    with pytest.raises(ResourceError, match=re.escape(message)):
        filter_resources(POOL, include, exclude)


def test_parse_node_specs() -> None:
    assert parse_node_specs("a@b:3,1@a:2") == {"a": [2], "b": [1, 3]}


def test_num_nodes_and_gpus_on_a_hostfile() -> None:
    active = filter_resources(POOL)
    assert limit_resources(active, 2, None) == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
    assert limit_resources(active, None, 3) == {"worker-0": [0, 1, 2], "worker-1": [0, 1, 2], "worker-2": [0, 1, 2]}
    with pytest.raises(ResourceError, match="--num_nodes: 4 nodes asked for, the hostfile has 3"):
        limit_resources(active, 4, None)


def test_visible_devices_only_when_slots_are_not_0_to_n() -> None:
    assert visible_devices([0, 1, 2]) is None
    assert visible_devices([1, 3]) == "1,3"
    assert visible_devices([1]) == "1"


# DeepSpeed as the oracle (its runner module imports the whole of deepspeed: a few seconds).
hosts = st.lists(st.sampled_from(["a", "b", "c", "worker-1"]), min_size=1, max_size=4, unique=True)


@st.composite
def pools_and_specs(draw: st.DrawFn) -> tuple[dict[str, int], str]:
    pool = {h: draw(st.integers(1, 4)) for h in draw(hosts)}
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        host = draw(st.sampled_from(sorted(pool)))
        slots = draw(st.lists(st.integers(0, pool[host] - 1), max_size=3))
        parts.append(host + (":" + ",".join(map(str, slots)) if slots else ""))
    return pool, "@".join(parts)


@settings(max_examples=150, deadline=None)
@given(pools_and_specs(), st.booleans())
def test_filters_match_deepspeed(case: tuple[dict[str, int], str], include: bool) -> None:
    runner = pytest.importorskip("deepspeed.launcher.runner")
    pool, spec = case
    args = (spec, "") if include else ("", spec)
    assert filter_resources(pool, *args) == dict(runner.parse_inclusion_exclusion(pool, *args))


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(["a", "node-1", "10.0.0.2", "b.cluster"]), st.integers(1, 16), min_size=1),
       st.sampled_from(["", " # note", " max_slots=9"]))
def test_hostfile_matches_deepspeed(pool: dict[str, int], suffix: str) -> None:
    runner = pytest.importorskip("deepspeed.launcher.runner")
    lines = ["# header", *(f"{h} slots={n}{suffix}" for h, n in pool.items()), ""]
    assert parse_hostfile(lines) == dict(runner._parse_hostfile(lines))


# ---------------------------------------------------------------- environment


def test_env_file(tmp_path: Path) -> None:
    path = tmp_path / ".deepspeed_env"
    path.write_text("# comment\n\nNCCL_IB_DISABLE=1\n LD_LIBRARY_PATH = /opt/x:$LD_LIBRARY_PATH \nEMPTY=\nA=b=c\n")
    assert multinode.read_env_file(path) == {
        "NCCL_IB_DISABLE": "1", "LD_LIBRARY_PATH": "/opt/x:$LD_LIBRARY_PATH", "EMPTY": "", "A": "b=c",
    }
    path.write_text("A=1\nexport B\n")
    with pytest.raises(ResourceError, match=re.escape(f"{path}:2: expected KEY=VALUE")):
        multinode.read_env_file(path)
    path.write_text("1A=1\n")
    with pytest.raises(ResourceError, match=":1: expected KEY=VALUE"):
        multinode.read_env_file(path)


def test_forwarded_env(tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("X=home\nY=home\n")
    (cwd / ".deepspeed_env").write_text("Y=cwd value\n")
    (cwd / "alt_env").write_text("Z=alt\n")
    environ = {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/lib", "UCX_TLS": "tcp", "MLFLOW_X": "1", "HOME": str(home),
               "CUDA_HOME": "/cuda", "ZEROSHARD_ARRIVAL_TIMEOUT": "30", "ZEROSHARD_LAUNCH_ATTEMPT": "2", "OTHER": "x"}
    exports = multinode.forwarded_env(environ, str(cwd), str(home))
    assert exports == {
        "NCCL_DEBUG": "INFO", "PYTHONPATH": shlex.quote(f"{cwd}:/lib"), "UCX_TLS": "tcp", "MLFLOW_X": "1",
        "ZEROSHARD_ARRIVAL_TIMEOUT": "30", "X": "home", "Y": '"cwd value"',  # the working directory's file wins
    }
    assert multinode.forwarded_env({**environ, "DS_ENV_FILE": "alt_env"}, str(cwd), str(home))["Z"] == "alt"


# ---------------------------------------------------------------- per-host commands


def _jobs(remote: multinode.Remote, hosts: dict[str, list[int]] | None = None) -> list[multinode.HostJob]:
    hosts = hosts or {"w0": [0, 1], "w1": [1, 3]}
    return multinode.host_jobs(hosts, ["--max_restarts", "1"], ["train.py", "--lr", "1 2"], ("w0", 29500),
                               "job-1", remote)


def test_ssh_commands() -> None:
    remote = multinode.Remote("ssh", 2222, "-o StrictHostKeyChecking=no", "/venv/bin/activate", "/work dir",
                              {"PYTHONPATH": "/work", "FOO": '"$HOME/x"'})
    jobs = _jobs(remote)
    assert [job.command[:6] for job in jobs] == [
        ["ssh", "-p", "2222", "-o", "StrictHostKeyChecking=no", "w0"],
        ["ssh", "-p", "2222", "-o", "StrictHostKeyChecking=no", "w1"],
    ]
    steps = [job.command[6].split("; ") for job in jobs]
    assert steps[0][:4] == ["source /venv/bin/activate", "cd '/work dir' || exit 1", "export PYTHONPATH=/work",
                            'export FOO="$HOME/x"']
    assert "export CUDA_VISIBLE_DEVICES=1,3" in steps[1] and not any("CUDA" in s for s in steps[0])
    for rank, step in enumerate(steps):
        argv = shlex.split(step[-1])
        assert argv[:8] == ["exec", sys.executable, "-u", "-m", "zeroshard.cli.main", "launch", "--rdzv_id", "job-1"]
        assert argv[8:] == ["--node_rank", str(rank), "--nnodes", "2", "--nproc_per_node", "2", "--master_addr",
                            "w0", "--master_port", "29500", "--max_restarts", "1", "train.py", "--lr", "1 2"]


def test_kill_command_finds_its_host_launcher_and_not_itself() -> None:
    jobs = _jobs(multinode.Remote("ssh", cwd="/w"))
    for rank, job in enumerate(jobs):
        assert job.kill_command[:2] == ["ssh", job.host]
        kill = shlex.split(job.kill_command[2])
        assert kill[:3] == ["pkill", "-TERM", "-f"]
        pattern = re.compile(kill[3])  # POSIX ERE; this subset reads the same in Python
        launcher = " ".join(shlex.split(job.command[2].split("; ")[-1])[1:])
        assert pattern.search(launcher), launcher
        assert not pattern.search(" ".join(job.kill_command))  # pkill -f never matches the kill command
        other = " ".join(shlex.split(jobs[1 - rank].command[2].split("; ")[-1])[1:])
        assert not pattern.search(other)
        assert not pattern.search(launcher.replace("job-1", "job-10"))


def test_pdsh_commands_and_env() -> None:
    remote = multinode.Remote("pdsh", 2222, cwd="/w")
    jobs = _jobs(remote)
    assert jobs[1].command[:6] == ["pdsh", "-S", "-f", "1024", "-w", "w1"]
    assert jobs[1].kill_command[:6] == ["pdsh", "-S", "-f", "1024", "-w", "w1"]
    env = multinode.launcher_env({"PATH": "/bin"}, remote)
    assert env["PDSH_RCMD_TYPE"] == "ssh" and env["PDSH_SSH_ARGS_APPEND"] == "-p 2222"
    assert multinode.describe(jobs, remote).startswith("PDSH_RCMD_TYPE=ssh PDSH_SSH_ARGS_APPEND='-p 2222' pdsh ")


# ---------------------------------------------------------------- zeroshard launch with these options


@pytest.fixture
def scripts(tmp_path: Path) -> dict[str, str]:
    paths = {"ds": tmp_path / "ds.py", "plain": tmp_path / "plain.py", "hf": tmp_path / "hf"}
    paths["ds"].write_text("import argparse\np = argparse.ArgumentParser()\np.add_argument('--local_rank', type=int)\n")
    paths["plain"].write_text("import os\nrank = int(os.environ['LOCAL_RANK'])\n")
    paths["fire"] = tmp_path / "fire_script.py"  # HelloDeepSpeed's train_bert_ds.py declares it so
    paths["fire"].write_text("import fire\ndef train(lr: float = 1e-4, local_rank: int = -1):\n    pass\n"
                             "if __name__ == '__main__':\n    fire.Fire(train)\n")
    paths["fire_env"] = tmp_path / "fire_env.py"  # Fire, but the rank read from the environment
    paths["fire_env"].write_text("import fire, os\nlocal_rank = int(os.environ['LOCAL_RANK'])\nfire.Fire(print)\n")
    paths["hf"].write_text("w0 slots=2\nw1 slots=4\n")
    return {name: str(path) for name, path in paths.items()}


def _dry_run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[list[str]]:
    assert launch.main(["--dry-run", *argv]) == 0
    return [shlex.split(line) for line in capsys.readouterr().out.splitlines()]


def test_local_rank_is_passed_to_scripts_that_declare_it(scripts: dict[str, str]) -> None:
    assert launch.build_torchrun_argv([scripts["ds"], "--x", "1"])[-5:] == [
        "--", scripts["ds"], launch.LOCAL_RANK_ARG, "--x", "1"]
    assert launch.build_torchrun_argv([scripts["plain"], "--x"])[-3:] == ["--", scripts["plain"], "--x"]
    assert launch.LOCAL_RANK_ARG not in launch.build_torchrun_argv(["--no_local_rank", scripts["ds"]])
    assert launch.LOCAL_RANK_ARG not in launch.build_torchrun_argv(["-m", "pkg.train"])
    assert launch.build_torchrun_argv([scripts["fire"]])[-2:] == [scripts["fire"], launch.LOCAL_RANK_ARG]
    assert launch.LOCAL_RANK_ARG not in launch.build_torchrun_argv([scripts["fire_env"]])


def test_local_rank_macro_is_torchruns() -> None:
    from torch.distributed.elastic.utils.api import macros

    assert macros.substitute([launch.LOCAL_RANK_ARG], "3") == ["--local_rank=3"]


def test_hostfile_of_several_hosts_prints_one_command_per_host(
        capsys: pytest.CaptureFixture[str], scripts: dict[str, str]) -> None:
    commands = _dry_run(capsys, ["--hostfile", scripts["hf"], "--launcher", "ssh", scripts["ds"], "--a"])
    assert [cmd[0:2] for cmd in commands] == [["ssh", "w0"], ["ssh", "w1"]]
    remote = [shlex.split(cmd[2].split("; ")[-1]) for cmd in commands]
    assert [r[r.index("--nproc_per_node") + 1] for r in remote] == ["2", "4"]
    assert all(r[r.index("--master_addr") + 1] == "w0" and r[-2:] == [scripts["ds"], "--a"] for r in remote)
    include = _dry_run(capsys, ["-H", scripts["hf"], "-i", "w1:1,2", "--force_multi", "--launcher", "ssh",
                                scripts["ds"]])
    assert len(include) == 1 and "export CUDA_VISIBLE_DEVICES=1,2" in include[0][2]


def _env_and_argv(command: list[str]) -> tuple[dict[str, str], list[str]]:
    """A dry-run line ``VAR=value ... python -m torch.distributed.run ARGS``: its variables and ARGS."""
    i = command.index("torch.distributed.run")
    return dict(t.split("=", 1) for t in command[: i - 2]), command[i + 1:]


def test_one_host_runs_here(capsys: pytest.CaptureFixture[str], scripts: dict[str, str]) -> None:
    (command,) = _dry_run(capsys, ["--hostfile", scripts["hf"], "--include", "w1:1,3", scripts["ds"]])
    env, argv = _env_and_argv(command)
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3" and env["LOCAL_SIZE"] == "2"
    assert argv[:4] == ["--nproc_per_node", "2", "--nnodes", "1"]
    assert argv[-3:] == ["--", scripts["ds"], launch.LOCAL_RANK_ARG]


def test_no_ssh_launches_this_node_of_the_hostfile(capsys: pytest.CaptureFixture[str], scripts: dict[str, str]) -> None:
    (command,) = _dry_run(capsys, ["--hostfile", scripts["hf"], "--no_ssh", "--node_rank", "1", scripts["plain"]])
    env, argv = _env_and_argv(command)
    assert argv == ["--nproc_per_node", "4", "--nnodes", "2", "--node_rank", "1", "--master_addr", "w0",
                    "--master_port", "29500", "--", scripts["plain"]]
    assert (env["LOCAL_SIZE"], env["CROSS_RANK"], env["CROSS_SIZE"]) == ("4", "1", "2")


@pytest.mark.parametrize(("argv", "message"), [
    (["-H", "{hf}", "-i", "w0", "--num_gpus", "1"], "--include/--exclude: not allowed with --num_nodes/--num_gpus"),
    (["-H", "{hf}", "--num_gpus", "auto"], "--num_gpus: with a hostfile, expected a positive integer"),
    (["-H", "{hf}", "--num_nodes", "1:2"], "--num_nodes: with a hostfile, expected a positive integer"),
    (["-H", "{hf}", "--no_ssh"], "--no_ssh: needs --node_rank"),
    (["-H", "{hf}", "--node_rank", "2"], "--node_rank: the hostfile leaves 2 hosts, got 2"),
    (["-H", "{hf}", "--standalone"], "--standalone: a single-node rendezvous"),
    (["--no_ssh"], "--no_ssh: needs a --hostfile"),
    (["--launcher", "openmpi"], "--launcher: 'openmpi' is not supported"),
    (["-H", "{bad}"], "bad.txt:1: expected 'HOST slots=N'"),
    (["-H", "{hf}", "-e", "w2"], "--exclude: host 'w2' is not in the hostfile"),
])
def test_usage_errors(capsys: pytest.CaptureFixture[str], scripts: dict[str, str], tmp_path: Path,
                      argv: list[str], message: str) -> None:
    (tmp_path / "bad.txt").write_text("w0 slots=two\n")
    argv = [a.format(hf=scripts["hf"], bad=tmp_path / "bad.txt") for a in argv]
    with pytest.raises(SystemExit) as info:
        launch.main(["--dry-run", *argv, scripts["ds"]])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_env_file_is_a_usage_error(capsys: pytest.CaptureFixture[str], scripts: dict[str, str],
                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "nohome"))
    (tmp_path / ".deepspeed_env").write_text("GOOD=1\nnot a line\n")
    with pytest.raises(SystemExit) as info:
        launch.main(["--dry-run", "-H", scripts["hf"], scripts["ds"]])
    assert info.value.code == 2
    assert ".deepspeed_env:2: expected KEY=VALUE" in capsys.readouterr().err


# ---------------------------------------------------------------- fuzzed command lines

DS_OPTIONS = ["-H", "--hostfile", "-i", "--include", "-e", "--exclude", "--num_nodes", "--num_gpus",
              "--num_accelerators", "--node_rank", "--master_addr", "--master_port", "--launcher", "--ssh_port",
              "--launcher_args", "--force_multi", "--no_ssh", "--no_ssh_check", "--no_local_rank", "--standalone"]
VALUES = ["<hf>", "<bad>", "<dir>", "w0", "w1:1,3", "w0@w1", "w1:9", "w0:x", "@", "0", "1", "2", "-1", "auto",
          "1:2", "ssh", "pdsh", "slurm", "", "h"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DS_OPTIONS), st.sampled_from(VALUES) | st.text(max_size=6),
                          st.booleans()), max_size=5))
def test_fuzzed_deepspeed_options_dry_run(tmp_path_factory: pytest.TempPathFactory,
                                          options: list[tuple[str, str, bool]]) -> None:
    """Each command line prints commands (``--dry-run``: nothing is started) or is a usage error
    (exit 2, ``error:``), never a traceback."""
    import contextlib
    import io

    root = tmp_path_factory.getbasetemp() / "fuzz_ds"
    root.mkdir(exist_ok=True)
    (root / "hf").write_text("w0 slots=2\nw1 slots=4\n")
    (root / "bad").write_text("w0 slots=2\nw0 slots=2\n")
    (root / "train.py").write_text("import argparse  # --local_rank\n")
    paths = {"<hf>": str(root / "hf"), "<bad>": str(root / "bad"), "<dir>": str(root)}
    argv: list[str] = []
    for option, value, with_value in options:
        argv += [option, paths.get(value, value)] if with_value and not value.startswith("-") else [option]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = launch.main(["--dry-run", *argv, str(root / "train.py")])
        except SystemExit as exit_:
            code = exit_.code
    assert code == 0 or (code == 2 and "error:" in err.getvalue()), (argv, code, err.getvalue())
