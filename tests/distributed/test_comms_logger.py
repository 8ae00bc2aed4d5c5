"""The communication logger (``comms_logger``) on 2 gloo ranks: what it counts is what each ZeRO stage
is known to send, and its summary follows DeepSpeed's.

Per optimizer step on :class:`ToyNet` in fp32, one bucket, ``P`` the padded parameter count (every
tensor rounded up to a multiple of the world size, the shard layout) and ``Q`` the plain one:

- stage 0: one all-reduce of the whole gradients (``4Q`` bytes: nothing is sharded, so no padding);
- stage 1: one reduce-scatter of ``4P`` bytes per step, one all-gather of the updated parameters
  (``4P``);
- stage 2: one reduce-scatter of ``4P`` bytes per micro-step, one all-gather of ``4P`` per step;
- stage 3: per micro-step, all-gathers of every parameter unit summing to ``4P`` (forward; small
  models are not re-gathered in backward) and reduce-scatters summing to ``4P``.

Each expectation is computed from the model's parameter shapes, not from zeroshard's buckets.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
from harness import log_lines, run_distributed
from models import make_model

import zeroshard
from zeroshard.config import load_config
from zeroshard.core.comm import collectives as C
from zeroshard.errors import ConfigError
from zeroshard.monitor import comms
from zeroshard.monitor.comms import CommsLogger, bus_factor, trim_mean

STEPS, GA, MICRO = 2, 2, 3
#: the agreement check's and ZeRO-3 gather guard's all-gather: eight int64 per rank
CONTROL_BYTES = 8 * 8 * 2


def _padded_bytes(world: int) -> int:
    return 4 * sum(math.ceil(p.numel() / world) * world for p in make_model().parameters())


def _plain_bytes() -> int:
    return 4 * sum(p.numel() for p in make_model().parameters())


def _train(engine: Any, rank: int, world: int, steps: int) -> list[float]:
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps * GA):
        x, y = torch.randn(MICRO, 11, generator=g), torch.randint(0, 5, (MICRO,), generator=g)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _engine(stage: int, comms: dict[str, Any] | None, **extra: Any) -> Any:
    cfg = {**extra, "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 10**6, "allgather_bucket_size": 10**6,
                                 "stage3_param_persistence_threshold": 0},
           "comms_logger": {"enabled": comms is not None, **(comms or {})}}
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=cfg)
    return engine


def comms_worker(rank: int, world: int) -> dict[str, Any]:
    lines = log_lines(logging.INFO)
    logging.getLogger("zeroshard").setLevel(logging.INFO)
    out: dict[str, Any] = {}
    for stage in (0, 1, 2, 3):
        engine = _engine(stage, {})
        _train(engine, rank, world, 1)  # warm-up; set-up and the first step's gathers are not counted
        engine.comms_summary(print_log=False, reset=True)
        _train(engine, rank, world, STEPS)
        lines.clear()
        out[f"stage{stage}"] = engine.comms_summary()["summary"]
        out[f"stage{stage}_log"] = list(lines)
    # debug names the caller; prof_all off with prof_ops logs only the listed collective; verbose
    # logs each one as it happens.
    engine = _engine(2, {"debug": True})
    _train(engine, rank, world, 1)
    out["debug"] = sorted(engine.comms_summary(print_log=False)["summary"])
    lines.clear()
    engine = _engine(2, {"prof_all": False, "prof_ops": ["allgather_fn"], "verbose": True})
    _train(engine, rank, world, 1)
    out["prof_ops"] = sorted(engine.comms_summary(print_log=False)["summary"])
    out["verbose"] = [line for line in lines if line.startswith("comm op: ")]
    engine.comms_logger.uninstall()
    # The FLOPs profiler under ZeRO-3 (parameters are shards at rest), next to the logger: rank 0 only.
    engine = _engine(3, {}, flops_profiler={"enabled": True, "profile_step": 0})
    _train(engine, rank, world, 1)
    prof = engine.flops_profiler.last if engine.flops_profiler is not None else None
    out["zero3_profile"] = None if prof is None else [prof.model.params, prof.fwd_flops]
    engine.comms_logger.uninstall()
    # Logged or not, training is the same (bit for bit on CPU): ZeRO-3, prefetching, the gloo ring.
    engine = _engine(3, {})
    logged = _train(engine, rank, world, 2)
    engine.comms_logger.uninstall()
    out["same_training"] = logged == _train(_engine(3, None), rank, world, 2)
    # Off: the summary is refused with the key to set, and nothing is recorded.
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    plain, _, _, _ = zeroshard.initialize(model=make_model(), config=cfg)
    try:
        plain.comms_summary()
        out["off"] = "no error"
    except ConfigError as e:
        out["off"] = str(e)
    return out


def _sizes(summary: dict[str, Any], op: str) -> dict[int, int]:
    return {size: e["count"] for size, e in summary.get(op, {}).items()}


def _bytes(summary: dict[str, Any], op: str, skip: int = -1) -> int:
    return sum(size * n for size, n in _sizes(summary, op).items() if size != skip)


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(comms_worker, 2, timeout=600)


def test_counts_and_bytes_follow_each_stage(results: list[dict[str, Any]]) -> None:
    padded = _padded_bytes(2)
    micro_steps = STEPS * GA
    for rank, res in enumerate(results):
        s0, s1, s2, s3 = (res[f"stage{k}"] for k in range(4))
        assert _sizes(s0, "all_reduce")[_plain_bytes()] == STEPS, (rank, s0)
        assert "reduce_scatter_tensor" not in s0 and _sizes(s0, "all_gather_into_tensor") == {
            CONTROL_BYTES: STEPS}, (rank, s0)
        assert _sizes(s1, "reduce_scatter_tensor") == {padded: STEPS}, (rank, s1)
        assert _sizes(s1, "all_gather_into_tensor")[padded] == STEPS, (rank, s1)
        assert _sizes(s2, "reduce_scatter_tensor") == {padded: micro_steps}, (rank, s2)
        assert _sizes(s2, "all_gather_into_tensor")[padded] == STEPS, (rank, s2)
        # Stage 3: every parameter gathered once per accumulation window (the default live budget keeps
        # the units gathered into the window's next forward), every gradient reduced once per micro-step.
        assert _bytes(s3, "all_gather_into_tensor", skip=CONTROL_BYTES) == padded * STEPS, (rank, s3)
        assert _bytes(s3, "reduce_scatter_tensor") == padded * micro_steps, (rank, s3)
        gathers = _sizes(s3, "all_gather_into_tensor")
        assert sum(n for size, n in gathers.items() if size != CONTROL_BYTES) == 4 * STEPS, gathers  # 4 modules


def test_summary_fields_and_bandwidth(results: list[dict[str, Any]]) -> None:
    for res in results:
        for stage in range(4):
            for op, sizes in res[f"stage{stage}"].items():
                for size, e in sizes.items():
                    assert e["msg_size_bytes"] == size and e["count"] > 0
                    assert 0 < e["avg_latency_ms"] and e["avg_latency_ms"] * e["count"] <= e["total_latency_ms"] * 1.5
                    want_busbw = e["tput_avg_gbps"] * bus_factor(op, 2)
                    assert e["busbw_avg_gbps"] == pytest.approx(want_busbw, rel=1e-9), (op, e)
                    if size:
                        assert e["tput_avg_gbps"] > 0


def test_summary_printed_on_rank_0_only(results: list[dict[str, Any]]) -> None:
    table = [line for line in results[0]["stage2_log"] if "Comm. Op" in line]
    assert len(table) == 1, results[0]["stage2_log"]
    assert "reduce_scatter_tensor" in table[0] and "busbw_avg (Gbps)" in table[0]
    assert not any("Comm. Op" in line for line in results[1]["stage2_log"])


def test_debug_prof_ops_verbose_and_off(results: list[dict[str, Any]]) -> None:
    res = results[0]
    assert res["debug"] and all(" | [Caller Func: " in name for name in res["debug"]), res["debug"]
    assert any(name.startswith("reduce_scatter_tensor | [Caller Func: _launch]") for name in res["debug"])
    assert res["prof_ops"] == ["all_gather_into_tensor"]
    assert res["verbose"] and all("all_gather_into_tensor" in line for line in res["verbose"])
    assert results[1]["verbose"] == []  # verbose lines come from rank 0
    assert "comms_logger.enabled" in res["off"]
    assert res["same_training"] and results[1]["same_training"]


def test_flops_profiler_under_zero3_on_rank_0(results: list[dict[str, Any]]) -> None:
    """Whole parameter counts although ZeRO-3 holds shards; both micro-steps' forwards counted."""
    model = make_model()
    linear = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert results[0]["zero3_profile"] == [sum(p.numel() for p in model.parameters()), GA * 2 * MICRO * linear]
    assert results[1]["zero3_profile"] is None


def test_prof_ops_names_are_checked() -> None:
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "comms_logger": {"prof_ops": ["all_to_al"]}}, 1)
    with pytest.raises(ConfigError, match="comms_logger.prof_ops: unknown collective 'all_to_al'"):
        CommsLogger(cfg.comms_logger, 0, 2)


def test_trim_mean_drops_a_tenth_at_each_end() -> None:
    assert trim_mean([1.0] * 9 + [100.0]) == 1.0
    assert trim_mean([]) == 0.0
    assert trim_mean([2.0, 4.0]) == 3.0


def test_bandwidths_are_nccl_tests_and_exit_summary(caplog: pytest.LogCaptureFixture) -> None:
    """1 MB in 1 ms on 4 ranks is 8 Gbps of algorithm bandwidth; the bus bandwidth multiplies it by
    2·3/4 for an all-reduce and 3/4 for an all-gather. A logger installed with calls not yet
    summarised prints its table at exit."""
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "comms_logger": {"enabled": True}}, 1)
    log = CommsLogger(cfg.comms_logger, 0, 4)
    log.record("all_reduce", "all_reduce", 10**6, 1e-3)
    log.record("all_gather_into_tensor", "all_gather_into_tensor", 10**6, 1e-3)
    log.record("all_gather_into_tensor", "all_gather_into_tensor", 10**6, 3e-3)
    out = log.summary(print_log=False)["summary"]
    assert out["all_reduce"][10**6]["tput_avg_gbps"] == pytest.approx(8.0)
    assert out["all_reduce"][10**6]["busbw_avg_gbps"] == pytest.approx(12.0)
    gather = out["all_gather_into_tensor"][10**6]
    assert gather["count"] == 2 and gather["total_latency_ms"] == pytest.approx(4.0)
    assert gather["avg_latency_ms"] == pytest.approx(2.0) and gather["msg_size_str"] == "976.56 KB"
    assert gather["busbw_avg_gbps"] == pytest.approx(0.75 * (8.0 + 8.0 / 3) / 2)
    try:
        log.install()
        with caplog.at_level("INFO", logger="zeroshard"):
            comms._summary_at_exit()  # nothing new since the summary above
            assert not caplog.records
            log.record("barrier", "barrier", 0, 1e-3)
            comms._summary_at_exit()
        assert "Comm. Op" in caplog.text and "barrier" in caplog.text
        assert comms.log_summary(return_dict=True)["summary"]["barrier"][0]["count"] == 1  # type: ignore[index]
    finally:
        log.uninstall()
    assert C.HOOK.recorder is None
    with pytest.raises(ConfigError, match="comms_logger.enabled"):
        comms.log_summary()
