"""DeepSpeed's engine API, module surface and config keys on a real 2-rank job, ZeRO stages 0-3.

One spawned run walks every public method and property of DeepSpeed 0.19.8's ``DeepSpeedEngine``
(from ``src/zeroshard/deepspeed/engine_api/deepspeed_engine_api.json``) on an engine at each stage: each
zero-argument method is called and each property read; those marked working must not raise, the
others must raise ``NotYetSupportedError`` naming themselves. Methods with arguments that scripts
notice are checked one by one (``backward``'s return, ``step(lr_kwargs=)``, ``no_sync``, batch-size
setters, checkpoints), as are ``deepspeed.utils.safe_get_*``, ``deepspeed.comm`` and the config
keys ``prescale_gradients``, ``gradient_predivide_factor`` and ``ignore_unused_parameters``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from harness import log_lines, run_distributed
from models import make_data, make_model, micro_batch, train_reference

LR = 1e-2
GLOBAL_BATCH = 8
ADAMW = {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}}
# fp32: reduction-order noise only (as tests/distributed/test_parity.py).
FP32_TOL = 1e-5


def _config(stage: int, ga: int, **extra: Any) -> dict[str, Any]:
    return {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": ga, "gradient_clipping": 0,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 600, "allgather_bucket_size": 900,
                                  "stage3_param_persistence_threshold": 0},
            "optimizer": ADAMW, **extra}


class _RecordingScheduler:
    """Records the keyword arguments of each ``step``."""

    def __init__(self, optimizer: Any) -> None:
        self.calls: list[dict[str, Any]] = []

    def step(self, **kwargs: Any) -> None:
        self.calls.append(kwargs)

    def state_dict(self) -> dict[str, Any]:
        return {"calls": len(self.calls)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _walk(engine: Any, methods: list[dict[str, Any]]) -> dict[str, str]:
    """Call every zero-argument method / read every property; ``name -> outcome``."""
    from zeroshard.errors import NotYetSupportedError

    out = {}
    for e in methods:
        name, kind = e["name"], e["kind"]
        if name == "destroy":
            continue  # last, on its own
        zero_arg = e["signature"] == "(self)" or e["status"] == "not-yet-supported"
        if kind in ("method", "contextmanager") and not zero_arg or kind == "staticmethod":
            out[name] = "explicit"
            continue
        try:
            if kind == "property":
                getattr(engine, name)
            elif kind == "contextmanager":
                with getattr(engine, name)():
                    pass
            else:
                getattr(engine, name)()
            out[name] = "works"
        except NotYetSupportedError as err:
            out[name] = "nys:" + ("named" if name in str(err) else str(err))
        except Exception as err:  # noqa: BLE001 - recorded and asserted on by the test
            out[name] = f"error:{type(err).__name__}:{err}"
    engine.train()
    return out


def _first_step(engine: Any, rank: int, world: int, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """Micro-steps of optimizer step 0 with the checks that need the window open."""
    from zeroshard.deepspeed.utils import (
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_get_local_optimizer_state,
    )

    ga = engine.gradient_accumulation_steps()
    micro_bs = GLOBAL_BATCH // (ga * world)
    out: dict[str, Any] = {"applied": []}
    # before the first step there is no optimizer state: None, as DeepSpeed's getters (it was a KeyError)
    out["state_before_step"] = [(safe_get_full_optimizer_state(p, "exp_avg"),
                                 safe_get_local_optimizer_state(p, "exp_avg")) for p in engine.module.parameters()]
    for m in range(ga):
        xb, yb = (micro_batch(t, 0, m, rank, world, micro_bs) for t in (x, y))
        loss = engine(xb, yb)
        returned = engine.backward(loss)
        out.setdefault("backward_return_ok", True)
        out["backward_return_ok"] &= bool(torch.equal(returned.detach(), loss.detach() / ga))
        if m == ga - 1:  # reduced, not yet stepped: the window's full gradients
            out["grads"] = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
        engine.step(lr_kwargs={"increment": 3})
        out["applied"].append(engine.was_step_applied())
    return out


def _utils_checks(engine: Any) -> dict[str, Any]:
    from zeroshard.deepspeed import utils

    out: dict[str, Any] = {}
    named = dict(engine.module.named_parameters())
    out["fp32"] = {n: utils.safe_get_full_fp32_param(p) for n, p in named.items()}
    out["exp_avg"] = {n: utils.safe_get_full_optimizer_state(p, "exp_avg") for n, p in named.items()}
    out["local_numel"] = sum(utils.safe_get_local_fp32_param(p).numel() for p in named.values())
    # engine.optimizer.state_dict(): this rank's part (as DeepSpeed's), the same values as the accessors
    sd = engine.optimizer.state_dict()

    def same_values(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:  # as multisets: orders differ
        return bool(torch.equal(torch.cat([t.reshape(-1) for t in a]).sort().values,
                                torch.cat([t.reshape(-1) for t in b]).sort().values))

    out["state_dict"] = {
        "meta": (sd["zero_stage"], sd["partition_count"], sd["rank"]),
        "masters": same_values(sd["fp32_master_shard"], [utils.safe_get_local_fp32_param(p) for p in named.values()]),
        "exp_avg": same_values([st["exp_avg"] for st in sd["base_optimizer_state"]["state"].values()],
                               [utils.safe_get_local_optimizer_state(p, "exp_avg") for p in named.values()])}
    p = named["out.bias"]
    value = torch.arange(5, dtype=torch.float32) / 7  # out.bias has 5 elements
    utils.safe_set_full_fp32_param(p, value)
    out["set_get"] = bool(torch.equal(utils.safe_get_full_fp32_param(p), value))
    with engine.gathered():
        out["set_module"] = bool(torch.equal(p.detach().float(), value))
    return out


def api_worker(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    import zeroshard as deepspeed
    from zeroshard.deepspeed.engine_api import API_DATA

    methods = json.loads(API_DATA.read_text())["methods"]
    x, y = make_data(2, GLOBAL_BATCH)
    results: dict[str, Any] = {}
    for stage in (0, 1, 2, 3):
        model = make_model(0)
        engine, _, _, sched = deepspeed.initialize(model=model, config=_config(stage, ga=2),
                                                   lr_scheduler=lambda opt: _RecordingScheduler(opt))
        r = _first_step(engine, rank, world, x, y)
        r["lr_kwargs"] = sched.calls
        r["loss_scale"], r["cur_scale"] = engine.loss_scale(), engine.cur_scale
        r["batch_info"] = engine.get_batch_info()
        r.update(_utils_checks(engine))
        r["walk"] = _walk(engine, methods)
        engine.set_train_batch_size(16)
        r["after_set_tbs"] = engine.get_batch_info()
        try:
            engine.set_train_batch_size(6)
        except ValueError:
            r["tbs_error"] = True
        engine.set_train_batch_size(GLOBAL_BATCH)
        engine.set_train_micro_batch_size(4)
        r["after_set_micro"] = engine.get_batch_info()
        engine.set_train_micro_batch_size(2)
        try:
            with engine.no_sync():
                engine.step()
        except Exception as err:  # noqa: BLE001 - the type and message are the result
            r["no_sync_error"] = f"{type(err).__name__}: {err}"
        r["module_sd_keys"] = sorted(engine.module_state_dict().keys())
        r["saved"] = engine.save_checkpoint(ckpt_dir, tag=f"s{stage}", client_state={"k": stage})
        path, client = engine.load_checkpoint(ckpt_dir, tag=f"s{stage}")
        r["loaded"] = (isinstance(path, str), client.get("k") if client else None)
        engine.destroy()
        results[stage] = r
    results["comm"] = _comm_checks(rank)
    return results


def _comm_checks(rank: int) -> dict[str, Any]:
    import zeroshard as deepspeed

    comm = deepspeed.comm
    t = torch.tensor([float(rank + 1)])
    comm.all_reduce(t, op=comm.ReduceOp.SUM, group=None)
    b = torch.tensor([float(rank + 10)])
    comm.broadcast(b, src=0, group=None)
    comm.barrier(group=None)
    gathered = [torch.zeros(1), torch.zeros(1)]
    comm.all_gather(gathered, torch.tensor([float(rank)]), group=None)
    return {"rank": comm.get_rank(), "world": comm.get_world_size(group=None), "sum": t.item(), "bcast": b.item(),
            "gathered": [g.item() for g in gathered], "local_rank": comm.get_local_rank(),
            "device": deepspeed.accelerator.get_accelerator().device_name()}


@pytest.fixture(scope="module")
def api_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(api_worker, 2, str(tmp_path_factory.mktemp("ckpt")), timeout=600)


def _reference_first_step() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Plain torch on the global batch of step 0: gradients, and AdamW's exp_avg after the step."""
    x, y = make_data(2, GLOBAL_BATCH)
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    model(x[0], y[0]).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    exp_avg = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    return grads, exp_avg


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_deepspeed_engine_method(api_results: list[dict[str, Any]], stage: int) -> None:
    from zeroshard.deepspeed.engine_api import API_DATA

    methods = json.loads(API_DATA.read_text())["methods"]
    walk = api_results[0][stage]["walk"]
    assert api_results[1][stage]["walk"] == walk, "ranks disagree"
    for e in methods:
        name, outcome = e["name"], walk.get(e["name"], "explicit")
        if outcome == "explicit" or name == "destroy":
            continue
        if name == "no_sync" and stage >= 2:  # DeepSpeed's rule: not with gradient partitioning
            assert outcome.startswith("error:ConfigError") and "stage" in outcome, outcome
        elif e["status"] == "works":
            assert outcome == "works", f"{name}: {outcome}"
        else:
            assert outcome == "nys:named", f"{name}: {outcome}"
    called = sum(1 for e in methods if walk.get(e["name"]) == "works")
    print(f"stage {stage}: {called} zero-argument methods/properties work when called")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_return_values(api_results: list[dict[str, Any]], stage: int) -> None:
    for r in (api_results[0][stage], api_results[1][stage]):
        assert r["backward_return_ok"], "backward must return loss / gradient_accumulation_steps"
        assert r["applied"] == [False, True], "was_step_applied: False mid-window, True after the update"
        assert all(pair == (None, None) for pair in r["state_before_step"]), r["state_before_step"]
        assert r["lr_kwargs"] == [{"increment": 3}], "step(lr_kwargs=) reaches the scheduler once per update"
        assert r["loss_scale"] == 0.0 and r["cur_scale"] == 1.0  # DeepSpeed: the config's fp16.loss_scale
        assert r["batch_info"] == (8, 2, 2)
        assert r["after_set_tbs"] == (16, 2, 4) and r["tbs_error"]
        assert r["after_set_micro"] == (16, 4, 2)
        assert r["no_sync_error"].startswith("ConfigError" if stage >= 2 else "RuntimeError")
        assert r["module_sd_keys"] == sorted(n for n, _ in make_model(0).named_parameters())
        assert r["saved"] is True and r["loaded"] == (True, stage)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_safe_get_accessors_match_plain_torch(api_results: list[dict[str, Any]], stage: int) -> None:
    grads, exp_avg = _reference_first_step()
    numel = sum(p.numel() for p in make_model(0).parameters())
    for r in (api_results[0][stage], api_results[1][stage]):
        for n, ref in grads.items():
            torch.testing.assert_close(r["grads"][n], ref, rtol=FP32_TOL, atol=1e-7, msg=f"grad {n}")
            torch.testing.assert_close(r["exp_avg"][n], exp_avg[n], rtol=FP32_TOL, atol=1e-8, msg=f"exp_avg {n}")
        assert r["set_get"] and r["set_module"]
        assert r["state_dict"]["masters"] and r["state_dict"]["exp_avg"]
    partitions = 1 if stage == 0 else 2
    assert [api_results[rank][stage]["state_dict"]["meta"] for rank in (0, 1)] == [(stage, partitions, 0),
                                                                                    (stage, partitions, 1)]
    for n in grads:
        assert torch.equal(api_results[0][stage]["fp32"][n], api_results[1][stage]["fp32"][n])
    local = [api_results[rank][stage]["local_numel"] for rank in (0, 1)]
    assert sum(local) == (2 * numel if stage == 0 else numel), local


def test_deepspeed_comm_and_accelerator(api_results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(res["comm"] for res in api_results):
        assert (r["rank"], r["world"], r["sum"], r["bcast"], r["gathered"]) == (rank, 2, 3.0, 10.0, [0.0, 1.0])
        assert r["local_rank"] == rank and r["device"] == "cpu"


# --------------------------------------------------------------------------- no_sync, external params, config keys
class _Head(torch.nn.Module):
    """Reads another module's weight (a tied projection): a ZeRO-3 external parameter."""

    def __init__(self, owner: torch.nn.Linear, register: bool) -> None:
        super().__init__()
        self.b = torch.nn.Linear(8, 8)
        self.__dict__["owner"] = owner  # not a submodule: only its weight is read here
        if register:
            import zeroshard

            zeroshard.zero.register_external_parameter(self, owner.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(x) @ self.owner.weight


class _Tied(torch.nn.Module):
    def __init__(self, register: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.head = _Head(self.a, register)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.a(x)))).pow(2).mean()


def _external(register: bool) -> dict[str, Any] | str:
    """ZeRO-3 with nothing kept gathered: ``head`` reads ``a.weight`` long after ``a`` ran."""
    import zeroshard

    cfg = {"train_batch_size": 4, "gradient_clipping": 0, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_max_live_parameters": 0, "stage3_prefetch_bucket_size": 0}}
    engine, *_ = zeroshard.initialize(model=_Tied(register), config=cfg)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))  # the same on both ranks
    try:
        for _ in range(2):
            engine.backward(engine(x))
            engine.step()
    except RuntimeError as err:
        return str(err)
    with engine.gathered():
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _train(engine: Any, rank: int, world: int, steps: int, no_sync_first: bool) -> dict[str, torch.Tensor]:
    """``steps`` optimizer steps of the global batch in two halves per rank; with ``no_sync_first``
    the first half's backward runs inside ``no_sync()`` (gradient_accumulation_steps 1)."""
    x, y = make_data(steps, GLOBAL_BATCH)
    half = GLOBAL_BATCH // (2 * world)
    for step in range(steps):
        parts = [(micro_batch(x, step, m, rank, world, half), micro_batch(y, step, m, rank, world, half))
                 for m in range(2)]
        if no_sync_first:
            with engine.no_sync():
                engine.backward(engine(*parts[0]) / 2)
            engine.backward(engine(*parts[1]) / 2)
            engine.step()
        else:
            for xb, yb in parts:
                engine.backward(engine(xb, yb))
                engine.step()
    with engine.gathered():
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def keys_worker(rank: int, world: int) -> dict[str, Any]:
    import zeroshard
    from zeroshard.errors import ConfigError

    out: dict[str, Any] = {}
    for stage in (0, 1):  # no_sync with gradient_accumulation_steps 1: the local sum of two halves
        engine, *_ = zeroshard.initialize(model=make_model(0), config={**_config(stage, ga=1)})
        out[f"no_sync/{stage}"] = _train(engine, rank, world, 2, no_sync_first=True)
    import logging

    lines = log_lines(logging.INFO)
    logging.getLogger("zeroshard").setLevel(logging.INFO)
    for stage, extra in ((0, {"prescale_gradients": True, "dump_state": True, "memory_breakdown": True}),
                         (1, {"gradient_predivide_factor": 4.0}),
                         (2, {"prescale_gradients": True}), (3, {"gradient_predivide_factor": 4.0})):
        engine, *_ = zeroshard.initialize(model=make_model(0), config=_config(stage, ga=2, **extra))
        out[f"factors/{stage}"] = engine.optimizer.sync.scaling
        out[f"scaling/{stage}"] = _train(engine, rank, world, 2, no_sync_first=False)
        if stage == 0:
            out["logs"] = "\n".join(lines)
    out["external/unregistered"] = _external(False)
    out["external/registered"] = _external(True)
    for stage in (1, 3):
        model = make_model(0)
        model.spare = torch.nn.Linear(3, 3)  # never used in forward
        cfg = _config(stage, ga=2)
        cfg["zero_optimization"]["ignore_unused_parameters"] = False
        engine, *_ = zeroshard.initialize(model=model, config=cfg)
        try:
            _train(engine, rank, world, 1, no_sync_first=False)
            out[f"unused/{stage}"] = "no error"
        except ConfigError as err:  # also an AssertionError, as DeepSpeed's (its TestStage2IgnoreUnusedParameters)
            out[f"unused/{stage}"] = f"AssertionError={isinstance(err, AssertionError)}: {err}"
    return out


def test_no_sync_and_gradient_scaling_keys_match_plain_torch() -> None:
    x, y = make_data(2, GLOBAL_BATCH)
    ref = {n: p.detach().clone() for n, p in train_reference(make_model(0), x, y, LR, 0.0).named_parameters()}
    w0 = dict(make_model(0).named_parameters())
    results = run_distributed(keys_worker, 2, timeout=600)
    # prescale: 1/world before the reduction; predivide 4: 1/4 before, 4/world after (DeepSpeed's placement)
    assert [results[0][f"factors/{s}"] for s in range(4)] == [(0.5, 1.0), (0.25, 2.0), (0.5, 1.0), (0.25, 2.0)]
    tied = _Tied(False)
    opt = torch.optim.SGD(tied.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        tied(torch.randn(2, 8, generator=torch.Generator().manual_seed(1))).backward()
        opt.step()
    # Registered or not (the read gathers it, as DeepSpeed's attribute access does: test_param_reads.py)
    for key in ("external/registered", "external/unregistered"):
        assert not isinstance(results[0][key], str), f"{key}: {results[0][key]}"
        for n, p in tied.named_parameters():
            for r in results:
                torch.testing.assert_close(r[key][n], p.detach(), rtol=FP32_TOL, atol=1e-7)
    # dump_state and memory_breakdown: rank 0 logs the config and its bytes at each step
    assert '"prescale_gradients": true' in results[0]["logs"] and "memory before step" in results[0]["logs"]
    assert "memory before step" not in results[1]["logs"]
    for key, params in results[0].items():
        if key.startswith(("factors/", "external/", "logs")):
            continue
        if key.startswith("unused/"):
            for r in results:
                assert "spare.weight" in r[key] and "spare.bias" in r[key] and "ignore_unused_parameters" in r[key]
                assert r[key].startswith("AssertionError=True"), r[key]
            continue
        for n, ref_p in ref.items():
            assert torch.equal(params[n], results[1][key][n]), f"{key}: ranks disagree on {n}"
            assert not torch.equal(ref_p, w0[n])
            rel = ((params[n] - ref_p).norm() / ref_p.norm()).item()
            assert rel <= FP32_TOL, f"{key}: {n} deviates by {rel:.2e}"
