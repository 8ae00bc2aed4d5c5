"""Defects that DeepSpeed's own unit tests found when run against zeroshard (issue #38), each
checked here against plain PyTorch on 2 gloo ranks:

* ``initialize`` called inside ``with zero.Init():`` deadlocked (rank 0 all-gathering a parameter the
  block still held lazily, rank 1 broadcasting it): DeepSpeed's ``TestDSInitWZinit``;
* a ``zero.Init`` nested in another (a composite model whose parts build under their own block)
  failed with an ``AssertionError`` on exit: ``test_zero_nesting_init.py``;
* a client optimizer whose param groups list frozen parameters failed with a ``KeyError`` at
  stages 1-3: ``TestZeroToFP32::test_2_param_groups``.

The reference is one process of plain PyTorch over the global batch, from the same initial values
(``zero.Init`` runs the constructors' initialisers on the same random stream). ToyNet's parameter
sizes are odd, so no parameter divides evenly between the ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import run_distributed
from models import ToyNet, gathered_weights, make_data, micro_batch, relative_distance

import zeroshard
from zeroshard.config import load_config

STEPS, MB, WORLD, LR, TOL = 4, 3, 2, 1e-2, 1e-5


def _config(stage: int | None, optimizer: bool = True) -> dict[str, Any]:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": MB, "gradient_clipping": 0.0}
    if optimizer:
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": LR}}
    if stage is not None:  # None: no zero_optimization block at all, as in DeepSpeed's test
        cfg["zero_optimization"] = {"stage": stage, "stage3_param_persistence_threshold": 0}
    return cfg


def _train(engine: Any, rank: int, world: int) -> dict[str, torch.Tensor]:
    x, y = make_data(STEPS, MB * world)
    for step in range(STEPS):
        xs, ys = micro_batch(x, step, 0, rank, world, MB), micro_batch(y, step, 0, rank, world, MB)
        engine.backward(engine(xs, ys))
        engine.step()
    weights = gathered_weights(engine)
    engine.destroy()
    return weights


def _reference(make_optimizer: Any, frozen: tuple[str, ...] = (),
               model: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    """Plain PyTorch over the global batch, from ``model`` (default: ToyNet from seed 0)."""
    if model is None:
        torch.manual_seed(0)
        model = ToyNet()
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    opt = make_optimizer(model)
    x, y = make_data(STEPS, MB * WORLD)
    for step in range(STEPS):
        opt.zero_grad()
        model(x[step], y[step]).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=LR)


def _initialize_inside_init(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for stage in (None, 2, 3):
        torch.manual_seed(0)
        with zeroshard.zero.Init():
            model = ToyNet()
            engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                              config=_config(stage))
        out[str(stage)] = _train(engine, rank, world)
    return out


def test_initialize_inside_zero_init_trains_as_plain_torch() -> None:
    """No zero_optimization block (stage 0, the deadlock), stage 2 and stage 3: every stage
    gathers or adopts what the block partitioned, and trains as plain PyTorch does."""
    ref = _reference(_adam)
    for rank, result in enumerate(run_distributed(_initialize_inside_init, WORLD, timeout=120)):
        for stage, weights in result.items():
            assert relative_distance(weights, ref) <= TOL, (rank, stage, relative_distance(weights, ref))


def _nested_init(rank: int, world: int) -> dict[str, Any]:
    cfg = _config(3)
    torch.manual_seed(0)
    with zeroshard.zero.Init(config_dict_or_path=cfg):
        with zeroshard.zero.Init(config_dict_or_path=cfg):
            first = ToyNet()
        # settled by the inner block's end, while the outer block is still open
        settled = all(hasattr(p, "ds_id") and p.numel() == 0 for p in first.parameters())
        engine1, *_ = zeroshard.initialize(model=first, model_parameters=first.parameters(), config=cfg)
        torch.manual_seed(0)
        with zeroshard.zero.Init(config_dict_or_path=cfg):
            second = ToyNet()
        torch.manual_seed(0)
        third = ToyNet()  # the outer block's own, after a nested one ended
    partitioned = all(hasattr(p, "ds_id") and p.numel() == 0 for m in (second, third) for p in m.parameters())
    engine2, *_ = zeroshard.initialize(model=second, model_parameters=second.parameters(), config=cfg)
    engine3, *_ = zeroshard.initialize(model=third, model_parameters=third.parameters(), config=cfg)
    return {"settled": settled, "partitioned": partitioned,
            "weights": [_train(e, rank, world) for e in (engine1, engine2, engine3)]}


def test_nested_zero_init_partitions_once_and_trains_as_plain_torch() -> None:
    ref = _reference(_adam)
    for rank, result in enumerate(run_distributed(_nested_init, WORLD, timeout=120)):
        assert result["settled"] and result["partitioned"], (rank, result["settled"], result["partitioned"])
        for i, weights in enumerate(result["weights"]):
            assert relative_distance(weights, ref) <= TOL, (rank, i, relative_distance(weights, ref))


FROZEN = ("embed.weight", "embed.bias")


def _client_groups(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Hugging Face-style decay / no-decay groups built over every parameter, frozen ones included."""
    named = list(model.named_parameters())
    return torch.optim.SGD([{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.01},
                            {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0}],
                           lr=LR, momentum=0.9)


def _frozen_in_groups(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = ToyNet()
        for name in FROZEN:
            model.get_parameter(name).requires_grad_(False)
        optimizer = _client_groups(model)
        engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), optimizer=optimizer,
                                          config=_config(stage, optimizer=False))
        out[stage] = _train(engine, rank, world)
    return out


def test_client_optimizer_groups_with_frozen_parameters() -> None:
    """The frozen parameters stay as built; the rest train as torch's SGD over the same groups."""
    ref = _reference(_client_groups, FROZEN)
    torch.manual_seed(0)
    initial = {n: p.detach() for n, p in ToyNet().named_parameters()}
    assert relative_distance(initial, ref) > 100 * TOL, "the reference barely trained"
    for rank, result in enumerate(run_distributed(_frozen_in_groups, WORLD, timeout=120)):
        for stage, weights in result.items():
            assert relative_distance(weights, ref) <= TOL, (rank, stage, relative_distance(weights, ref))
            for name in FROZEN:
                assert torch.equal(weights[name], initial[name]), (rank, stage, name)


if __name__ == "__main__":
    pytest.main([__file__, "-q"])


GA = 2
#: gradient_allreduce_op "sum" divides by nothing: prescale_gradients and gradient_predivide_factor
#: change nothing then (DeepSpeed's TestGradientAllreduceOp, all three combinations)
SUM_CASES = [(stage, extra) for stage in (0, 1, 2)
             for extra in ({}, {"prescale_gradients": True}, {"gradient_predivide_factor": 2.0})]


def _sum_reference() -> dict[str, torch.Tensor]:
    """Plain PyTorch: the gradient of each step is the sum over the ranks of their own
    (accumulation-averaged) gradients, i.e. WORLD times the global batch's mean."""
    torch.manual_seed(0)
    model = ToyNet()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = make_data(STEPS, MB * WORLD * GA)
    for step in range(STEPS):
        opt.zero_grad()
        (model(x[step], y[step]) * WORLD).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _allreduce_sum(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    out = []
    x, y = make_data(STEPS, MB * world * GA)
    for stage, extra in SUM_CASES:
        torch.manual_seed(0)
        model = ToyNet()
        cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GA, "gradient_clipping": 0.0,
               "gradient_allreduce_op": "sum", "optimizer": {"type": "SGD", "params": {"lr": LR}},
               "zero_optimization": {"stage": stage}, **extra}
        engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        for step in range(STEPS):
            for micro in range(GA):
                xs, ys = (micro_batch(t, step, micro, rank, world, MB) for t in (x, y))
                engine.backward(engine(xs, ys))
                engine.step()
        out.append(gathered_weights(engine))
        engine.destroy()
    return out


def test_gradient_allreduce_op_sum_trains_as_plain_torch() -> None:
    ref = _sum_reference()
    for rank, result in enumerate(run_distributed(_allreduce_sum, WORLD, timeout=120)):
        for (stage, extra), weights in zip(SUM_CASES, result):
            assert relative_distance(weights, ref) <= TOL, (rank, stage, extra, relative_distance(weights, ref))


@pytest.mark.parametrize("value, stage, says", [
    ("sum", 3, "not supported with ZeRO stage 3"),
    ("max", 2, "gradient_allreduce_op"),
])
def test_gradient_allreduce_op_refusals(value: str, stage: int, says: str) -> None:
    cfg = {"train_batch_size": 2, "gradient_allreduce_op": value, "zero_optimization": {"stage": stage}}
    with pytest.raises(zeroshard.ConfigError, match=says) as info:
        load_config(cfg, world_size=2)
    assert info.value.key == "gradient_allreduce_op"


def _ds_tensor(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = ToyNet()
        cfg = _config(3)
        cfg["bf16"] = {"enabled": precision == "bf16"}
        engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        x, y = make_data(1, MB * world)
        engine.backward(engine(micro_batch(x, 0, 0, rank, world, MB), micro_batch(y, 0, 0, rank, world, MB)))
        engine.step()
        parts = {n: (p.ds_tensor.clone(), p.partition_numel(), p.ds_tensor.dtype)
                 for n, p in engine.module.named_parameters()}
        with engine.gathered():
            full = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        out[precision] = {"parts": parts, "full": full}
        engine.destroy()
    return out


def test_ds_tensor_is_this_ranks_partition() -> None:
    """DeepSpeed's ``p.ds_tensor`` at stage 3: this rank's padded chunk of the flattened parameter, as
    the gathered parameter has it. Its dtype is the shard's: in 16-bit training on CPU zeroshard
    gathers from the fp32 masters and keeps no 16-bit copy, so it is the master chunk (a cast of it
    is what is gathered)."""
    for rank, result in enumerate(run_distributed(_ds_tensor, WORLD, timeout=120)):
        for precision in ("fp32", "bf16"):
            got = result[precision]
            for name, (part, numel, part_dtype) in got["parts"].items():
                flat = got["full"][name].reshape(-1)
                k = -(-flat.numel() // WORLD)
                assert part.numel() == numel == k and part_dtype in (flat.dtype, torch.float32), (rank, name)
                mine = flat[rank * k : (rank + 1) * k]
                assert torch.equal(part[: mine.numel()].to(flat.dtype), mine), (rank, precision, name)
                assert not part[mine.numel():].any(), (rank, precision, name)  # the padding


def _init_status(rank: int, world: int) -> dict[str, Any]:
    from zeroshard.zero.param_status import ZeroParamStatus as S

    with zeroshard.zero.Init():
        layer = torch.nn.Linear(4, 3)
    seen = [layer.weight.ds_status == S.NOT_AVAILABLE, layer.weight.numel() == 0,
            layer.weight.ds_tensor.numel() == 6]  # 12 elements over 2 ranks
    with zeroshard.zero.GatheredParameters(layer.weight, modifier_rank=1):
        seen += [layer.weight.ds_status == S.AVAILABLE, layer.weight.shape == (3, 4)]
        if rank == 1:
            with torch.no_grad():
                layer.weight.zero_()
    seen.append(layer.weight.ds_status == S.NOT_AVAILABLE)
    with zeroshard.zero.GatheredParameters(layer.weight):
        seen.append(bool((layer.weight == 0).all()))  # rank 1's change reached every rank
    return {"seen": seen, "outside": not hasattr(torch.nn.Linear(4, 3).weight, "ds_status")}


def test_zero_init_parameters_carry_deepspeeds_status() -> None:
    """DeepSpeed's TestScatterGather / TestGatherUpdate: ``ds_status`` and ``ds_tensor`` from the end of
    the block, AVAILABLE inside GatheredParameters, and a modifier rank's change kept."""
    for rank, result in enumerate(run_distributed(_init_status, WORLD, timeout=60)):
        assert all(result["seen"]) and result["outside"], (rank, result)


def _stage_classes(rank: int, world: int) -> dict[str, Any]:
    from zeroshard.deepspeed.param_offload import ZeROOrderedDict
    from zeroshard.deepspeed.stage_classes import DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3

    out = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = ToyNet()
        engine, optimizer, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                                     config=_config(stage))
        x, y = make_data(1, MB * world)
        engine.backward(engine(micro_batch(x, 0, 0, rank, world, MB), micro_batch(y, 0, 0, rank, world, MB)))
        before = optimizer._get_norm_groups()
        engine.step()
        out[stage] = {"classes": (isinstance(optimizer, DeepSpeedZeroOptimizer),
                                  isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3)),
                      "gathering": isinstance(model.hidden._parameters, ZeROOrderedDict),
                      "norm": (len(before), float(before[0]), optimizer._global_grad_norm)}
        engine.destroy()
    return out


def test_deepspeed_optimizer_classes_and_norm_groups() -> None:
    """DeepSpeed's stage classes answer isinstance by stage; ``_get_norm_groups()`` before the step is
    the norm the step then clips by; ZeRO-3's modules hold DeepSpeed's ZeROOrderedDict."""
    for rank, result in enumerate(run_distributed(_stage_classes, WORLD, timeout=120)):
        for stage in (1, 2, 3):
            got = result[stage]
            assert got["classes"] == (stage < 3, stage == 3), (rank, stage, got)
            assert got["gathering"] == (stage == 3), (rank, stage, got)
            groups, before, after = got["norm"]
            assert groups == 1 and before > 0 and abs(before - after) <= 1e-6 * after, (rank, stage, got)


def _init_dtype(rank: int, world: int) -> dict[str, str]:
    out = {}
    for name, cfg in (("bf16", {"bf16": {"enabled": True}}), ("fp16", {"fp16": {"enabled": True}}),
                      ("auto", {"bf16": {"enabled": "auto"}}), ("none", None)):
        with zeroshard.zero.Init(config_dict_or_path=cfg):
            layer = torch.nn.Linear(4, 3)
        out[name] = str(layer.weight.ds_tensor.dtype)
    return out


def test_zero_init_keeps_the_configs_16_bit_dtype() -> None:
    """As DeepSpeed's zero.Init (its test_subclass_param_init): a config enabling fp16 or bf16 builds
    the chunks in it; "auto" (Hugging Face has not filled it in yet) and no config keep the constructed
    dtype (DeepSpeed would use fp16 without a config)."""
    for result in run_distributed(_init_dtype, WORLD, timeout=60):
        assert result == {"bf16": "torch.bfloat16", "fp16": "torch.float16", "auto": "torch.float32",
                          "none": "torch.float32"}, result


class _GrandPa(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.grandpa = torch.nn.Parameter(torch.ones(5))
        self.grandpa.data = (self.grandpa.data + 1).data


class _Son(_GrandPa):
    def __init__(self) -> None:
        super().__init__()
        self.son = torch.nn.Parameter(torch.arange(7.0))
        self.son.data = self.son.data * 2
        self.grandpa.data = self.grandpa.data + 1


def _data_assignment(rank: int, world: int) -> list[list[float]]:
    with zeroshard.zero.Init():
        model = _Son().cpu()  # Module.cpu() assigns .data too
    with zeroshard.zero.GatheredParameters(list(model.parameters())):
        return [model.grandpa.tolist(), model.son.tolist()]


def test_data_assigned_in_a_constructor_under_zero_init_is_kept() -> None:
    """``p.data = ...`` in a constructor under zero.Init (DeepSpeed's test_subclass_param_init): the
    values written are the parameter's (they were silently dropped: the chunk kept the old ones)."""
    for rank, got in enumerate(run_distributed(_data_assignment, WORLD, timeout=60)):
        assert got == [[3.0] * 5, [2.0 * i for i in range(7)]], (rank, got)


class _SkipInitNet(torch.nn.Module):
    """Layers built by torch.nn.utils.skip_init (on the meta device, then to_empty), one ordinary."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.utils.skip_init(torch.nn.Linear, 11, 37)
        self.b = torch.nn.Linear(37, 5)
        with torch.no_grad():  # skip_init leaves the values uninitialised: give them some
            self.a.weight.copy_(torch.linspace(-1, 1, 37 * 11).view(37, 11))
            self.a.bias.zero_()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.b(torch.tanh(self.a(x))), y)


def _skip_init(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    with zeroshard.zero.Init():
        model = _SkipInitNet()
    # placeholders, and this rank's elements (unpadded until initialize adopts them)
    partitioned = [(p.numel(), p.ds_tensor.numel(), p.ds_numel) for p in model.parameters()]
    with zeroshard.zero.GatheredParameters(list(model.parameters())):
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=_config(3))
    return {"partitioned": partitioned, "initial": initial, "trained": _train(engine, rank, world)}


def test_skip_init_under_zero_init_is_partitioned_and_trains() -> None:
    """DeepSpeed's TestParamPartitioningSkipInit: parameters built on the meta device and given values in
    the block are partitioned when the block settles (they were left whole, without ds_tensor)."""
    results = run_distributed(_skip_init, WORLD, timeout=120)
    ref_model = _SkipInitNet()
    ref_model.load_state_dict(results[0]["initial"])
    ref = _reference(_adam, model=ref_model)
    for i, (_, _, numel) in enumerate(results[0]["partitioned"]):
        assert all(r["partitioned"][i][0] == 0 for r in results), i
        assert sum(r["partitioned"][i][1] for r in results) == numel, (i, [r["partitioned"][i] for r in results])
    for rank, result in enumerate(results):
        assert all(torch.equal(result["initial"][n], results[0]["initial"][n]) for n in ref), rank
        assert relative_distance(result["trained"], ref) <= TOL, (rank, relative_distance(result["trained"], ref))
