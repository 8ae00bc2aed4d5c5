"""Monitors and the training report, one process: the CSV and TensorBoard files (read back), the
W&B and Comet adapters (against stand-in modules), missing packages, the token rule, the default
log handler, memory figures, and the reporter's per-step scalars and line."""

from __future__ import annotations

import csv
import importlib.machinery
import logging
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from zeroshard.config import load_config
from zeroshard.errors import ConfigError
from zeroshard.monitor import memory
from zeroshard.monitor.base import require
from zeroshard.monitor.csv_monitor import CSVMonitor, file_name
from zeroshard.monitor.logs import DefaultHandler, install_default_handler
from zeroshard.monitor.master import MonitorMaster
from zeroshard.monitor.report import Reporter, count_tokens
from zeroshard.monitor.timers import WallClockTimers

EVENTS = [("Train/Samples/train_loss", 2.5, 8), ("Train/Samples/lr", 1e-3, 8), ("Train/Samples/train_loss", 2.25, 16)]


def _cfg(**overrides: Any) -> Any:
    raw = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **overrides}
    return load_config(raw, 1)


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


# --------------------------------------------------------------------------- file monitors


def test_csv_layout_is_deepspeeds(tmp_path: Path) -> None:
    """One file per tag under output_path/job_name, DeepSpeed's name and header; rows readable after
    flush (before close); a reopened file gets no second header."""
    cfg = _cfg(csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "job"}).csv_monitor
    m = CSVMonitor(cfg)
    m.write_events(EVENTS)
    m.flush()
    loss = tmp_path / "job" / "Train_Samples_train_loss.csv"
    assert _rows(loss) == [["step", "train_loss"], ["8", "2.5"], ["16", "2.25"]]
    assert _rows(tmp_path / "job" / "Train_Samples_lr.csv") == [["step", "lr"], ["8", "0.001"]]
    m.close()
    again = CSVMonitor(cfg)
    again.write_events([("Train/Samples/train_loss", 2.0, 24)])
    again.close()
    assert _rows(loss)[1:] == [["8", "2.5"], ["16", "2.25"], ["24", "2.0"]]
    assert file_name("Train/Samples/a b") == "Train_Samples_a_b.csv"


def test_tensorboard_file_reads_back(tmp_path: Path) -> None:
    """Scalars at their steps in an event file under output_path/job_name, readable after flush."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from zeroshard.monitor.tensorboard import TensorBoardMonitor

    m = TensorBoardMonitor(_cfg(tensorboard={"enabled": True, "output_path": str(tmp_path), "job_name": "tb"})
                           .tensorboard)
    m.write_events(EVENTS)
    m.flush()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("Train/Samples/train_loss")] == [(8, 2.5), (16, 2.25)]
    assert [e.step for e in acc.Scalars("Train/Samples/lr")] == [8]
    m.close()


# --------------------------------------------------------------------------- optional packages


def test_missing_package_names_key_and_package() -> None:
    with pytest.raises(ConfigError) as e:
        require("zeroshard_no_such_package", "wandb.enabled")
    assert e.value.key == "wandb.enabled" and "pip install zeroshard_no_such_package" in str(e.value)


@pytest.mark.parametrize(("block", "package"), [("wandb", "wandb"), ("comet", "comet_ml")])
def test_missing_monitor_package_fails_on_every_rank(block: str, package: str) -> None:
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    for rank in (0, 1):  # every rank checks, not only the writing one
        with pytest.raises(ConfigError) as e:
            MonitorMaster(_cfg(**{block: {"enabled": True}}), rank)
        assert e.value.key == f"{block}.enabled" and f"'{package}'" in str(e.value)


def _fake_module(name: str, monkeypatch: pytest.MonkeyPatch, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for k, v in attrs.items():
        setattr(mod, k, v)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def test_wandb_logs_each_step_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []
    _fake_module("wandb", monkeypatch, init=lambda **kw: calls.append(("init", kw)),
                 log=lambda data, step: calls.append(("log", (data, step))), finish=lambda: calls.append(("finish", 0)))
    master = MonitorMaster(_cfg(wandb={"enabled": True, "project": "p", "team": "t", "group": "g"}), 0)
    master.write_events(EVENTS)
    master.close()
    assert calls == [("init", {"project": "p", "group": "g", "entity": "t"}),
                     ("log", ({"Train/Samples/train_loss": 2.5, "Train/Samples/lr": 1e-3}, 8)),
                     ("log", ({"Train/Samples/train_loss": 2.25}, 16)), ("finish", 0)]


def test_comet_respects_samples_log_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    logged: list[tuple[str, float, int]] = []

    class Experiment:
        def log_metric(self, name: str, value: float, step: int) -> None:
            logged.append((name, value, step))

        def set_name(self, name: str) -> None:
            logged.append(("name", 0.0, 0))

        def end(self) -> None:
            pass

    _fake_module("comet_ml", monkeypatch, __version__="3.45.0", start=lambda **kw: Experiment())
    master = MonitorMaster(_cfg(comet={"enabled": True, "samples_log_interval": 10, "experiment_name": "x"}), 0)
    master.write_events([("a", 1.0, 4), ("a", 2.0, 8), ("a", 3.0, 14), ("b", 4.0, 14)])
    assert logged == [("name", 0.0, 0), ("a", 1.0, 4), ("a", 3.0, 14), ("b", 4.0, 14)]
    _fake_module("comet_ml", monkeypatch, __version__="3.40.1", start=lambda **kw: Experiment())
    with pytest.raises(ConfigError, match="3.41"):
        MonitorMaster(_cfg(comet={"enabled": True}), 0)


def test_only_rank_zero_writes(tmp_path: Path) -> None:
    cfg = _cfg(csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "j"})
    other = MonitorMaster(cfg, 1)
    other.write_events(EVENTS)
    assert other.enabled and other.monitors == [] and not (tmp_path / "j").exists()
    assert not MonitorMaster(_cfg(), 0).enabled


# --------------------------------------------------------------------------- tokens, memory


def test_token_rule() -> None:
    ids = torch.zeros(3, 7, dtype=torch.long)
    assert count_tokens((), {"input_ids": ids}) == 21
    assert count_tokens(({"input_ids": ids, "labels": ids},), {}) == 21
    assert count_tokens((ids, ids), {}) == 21
    assert count_tokens((torch.zeros(3, dtype=torch.long),), {}) == 0  # class labels, not tokens
    assert count_tokens((torch.zeros(3, 7),), {}) == 0  # features
    assert count_tokens((torch.zeros(3, 7, dtype=torch.bool),), {}) == 0
    assert count_tokens(([1, 2],), {}) == 0


def test_memory_figures() -> None:
    m = memory.sample(torch.device("cpu"))
    assert m.device_allocated is None and m.device_peak is None
    if sys.platform.startswith("linux"):
        assert m.host_rss is not None and 10 * 2**20 < m.host_rss <= (m.host_peak or 0) + 2**20
    assert memory.describe(m).startswith("host=") and "device=n/a" in memory.describe(m)


# --------------------------------------------------------------------------- the default handler


def _record(level: int) -> logging.LogRecord:
    return logging.LogRecord("zeroshard", level, __file__, 1, "hello %s", ("there",), None)


def test_default_handler_installs_only_without_handlers(monkeypatch: pytest.MonkeyPatch) -> None:
    lone = logging.getLogger("zeroshard-test-lone")
    lone.propagate = False  # nothing above it: as a bare script's "zeroshard" logger
    monkeypatch.setattr(lone, "handlers", [])
    monkeypatch.setattr(lone, "level", logging.NOTSET)
    assert install_default_handler(lone) and lone.level == logging.INFO
    assert not install_default_handler(lone)  # once
    configured = logging.getLogger("zeroshard-test-configured")
    monkeypatch.setattr(configured, "handlers", [logging.NullHandler()])
    assert not install_default_handler(configured) and not any(
        isinstance(h, DefaultHandler) for h in configured.handlers)


def test_default_handler_filter(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    rank = [0]
    handler = DefaultHandler(rank=lambda: rank[0])
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    handler.handle(_record(logging.INFO))
    assert "[INFO] [zeroshard] hello there" in capsys.readouterr().err
    rank[0] = 1  # other ranks: warnings only
    assert not handler.filter(_record(logging.INFO)) and handler.filter(_record(logging.WARNING))
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])  # configured later
    assert not handler.filter(_record(logging.WARNING))


# --------------------------------------------------------------------------- the reporter


class _State:
    def __init__(self) -> None:
        self.global_steps = self.global_samples = self.skipped_steps = 0
        self.scaler = SimpleNamespace(scale=1024.0)
        self.lr = 1e-3

    def get_lr(self) -> list[float]:
        return [self.lr]

    def get_global_grad_norm(self) -> float | None:
        return 0.5


class _Sink:
    enabled = True

    def __init__(self) -> None:
        self.events: list[tuple[str, float, int]] = []
        self.flushes = 0

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        self.events += events

    def flush(self) -> None:
        self.flushes += 1


def test_reporter_scalars_and_line(caplog: pytest.LogCaptureFixture) -> None:
    """Per-step scalars at global_samples: the host numbers written (and flushed) at every step, as
    DeepSpeed writes them, so a run that ends between intervals loses none of them; the losses
    once per interval, after the ranks' average; the line's fields."""
    cfg = _cfg(steps_per_print=2, wall_clock_breakdown=True, fp16={"enabled": True})
    timers = WallClockTimers(True, torch.device("cpu"))
    sink = _Sink()
    rep = Reporter(cfg, None, torch.device("cpu"), timers, sink)  # type: ignore[arg-type]
    state = _State()
    losses = [3.0, 2.0, 1.5]
    with caplog.at_level(logging.INFO, logger="zeroshard"):
        for step, loss in enumerate(losses, 1):
            rep.count_forward((torch.zeros(4, 5, dtype=torch.long),), {})
            with timers("forward"):
                pass
            state.global_steps, state.global_samples, state.lr = step, 4 * step, 1e-3 * step
            rep.step_done(state, torch.tensor(loss), applied=step != 2)
            if step == 1:  # the host numbers at once; the loss waits for the interval
                assert {tag for tag, _, _ in sink.events} >= {"Train/Samples/lr", "Train/Samples/loss_scale"}
                assert "Train/Samples/train_loss" not in {tag for tag, _, _ in sink.events} and sink.flushes == 1
    by_tag: dict[str, list[tuple[int, float]]] = {}
    for tag, value, x in sink.events:
        by_tag.setdefault(tag, []).append((x, value))
    assert by_tag["Train/Samples/train_loss"] == [(4, 3.0), (8, 2.0)]  # step 3 waits for its interval
    assert by_tag["Train/Samples/lr"] == [(4, 1e-3), (8, 2e-3), (12, 3e-3)]  # step 3's too: it was lost
    assert by_tag["Train/Samples/loss_scale"] == [(4, 1024.0), (8, 1024.0), (12, 1024.0)]
    assert by_tag["Train/Samples/grad_norm"] == [(4, 0.5), (12, 0.5)]  # step 2 was skipped
    assert [x for x, _ in by_tag["Train/Samples/elapsed_time_ms_forward"]] == [4, 8, 12]
    assert {"Train/Samples/elapsed_time_ms_" + s for s in ("backward", "backward_inner", "backward_allreduce",
                                                           "step")} <= set(by_tag)
    assert by_tag["Train/Samples/samples_per_sec"] == [(8, by_tag["Train/Samples/samples_per_sec"][0][1])]
    assert sink.flushes == 4  # each step's, and the interval's
    assert by_tag["Train/Samples/tokens_per_sec"][0][1] > 0
    (line,) = [r.getMessage() for r in caplog.records if "step=" in r.getMessage()]
    for field in ("step=2 ", "samples=8 ", "loss=2.5000 ", "lr=2.000e-03 ", "loss_scale=1024 ", "grad_norm=0.5 ",
                  "skipped=0 ", "step_time=", "samples/s=", "tokens/s=", "mem: host=", "ms/step: forward="):
        assert field in line, (field, line)


def test_reporter_idle_without_output() -> None:
    rep = Reporter(_cfg(), None, torch.device("cpu"), WallClockTimers(False, torch.device("cpu")),
                   MonitorMaster(_cfg(), 0))
    assert not rep.active and rep.interval is None
    rep.count_forward((torch.zeros(2, 3, dtype=torch.long),), {})
    assert rep._tokens == 0
