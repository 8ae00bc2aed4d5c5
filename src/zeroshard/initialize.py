"""``initialize``: DeepSpeed's entry point, returning ``(engine, optimizer, dataloader, lr_scheduler)``.

It resolves the config, sets up the process group and device, synchronises the initial weights
from rank 0, builds the stage over the trainable parameters (fp32 masters are taken *before*
the module is cast to the compute dtype, so no precision is lost at start), then the optimizer,
scheduler and data loader.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist

from zeroshard.activations import configure_from_initialize as _configure_activation_checkpointing
from zeroshard.config import ZeroshardConfig, load_config, to_dict
from zeroshard.config.no_effect import warn_no_effect
from zeroshard.config.zero import DEFAULT_LEAF_MODULE_CLASSES, LeafModuleConfig
from zeroshard.core.build import build_stage
from zeroshard.core.clock import StepClock
from zeroshard.core.comm import collectives as C
from zeroshard.core.comm import watchdog
from zeroshard.core.comm.groups import init_distributed, local_rank
from zeroshard.core.comm.topology import make_hybrid_groups
from zeroshard.core.device import default_device
from zeroshard.core.offload import OffloadPolicy
from zeroshard.core.partition import full_numel
from zeroshard.core.precision import PrecisionPolicy, make_loss_scaler
from zeroshard.core.zero3.units import (
    mark_fine_grained_leaves,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
)
from zeroshard.core.zero_optimizer import StageSpec, ZeroOptimizer
from zeroshard.deepspeed.engine import ZeroEngine
from zeroshard.deepspeed.optimizer import DEEPSPEED_STAGES
from zeroshard.deepspeed.param_attrs import DEEPSPEED_PARAM_ATTRS
from zeroshard.errors import ConfigError, NotYetSupportedError, ZeroshardError
from zeroshard.model_checks import check_model
from zeroshard.monitor.logs import install_default_handler
from zeroshard.optim import build_optimizer, build_scheduler
from zeroshard.optim.no_optimizer import NoOptimizer
from zeroshard.optim.shape_dependent import refuse_shape_dependent
from zeroshard.zero.external import add_external_parameters_accessor
from zeroshard.zero.init import materialize_init_params, outside_init

logger = logging.getLogger("zeroshard")

OptimizerArg = torch.optim.Optimizer | Callable[[list[dict[str, Any]]], torch.optim.Optimizer] | None


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _outside_zero_init(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``fn`` as if outside any open ``zero.Init`` block: DeepSpeed allows ``initialize`` inside
    one, and then the model's parameters are settled into partitioned ones first, and what the engine
    builds is not partitioned by the block."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with outside_init():
            return fn(*args, **kwargs)

    return wrapper


@_outside_zero_init
def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: OptimizerArg = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: torch.utils.data.Dataset | None = None,
    lr_scheduler: Any = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
    auto_values: dict[str, Any] | None = None,
    **unknown: Any,
) -> tuple[ZeroEngine, ZeroOptimizer, torch.utils.data.DataLoader | None, Any]:
    """Wrap ``model`` for ZeRO training, as ``deepspeed.initialize`` does.

    Args:
        args: an argparse namespace; its ``deepspeed_config`` is used when ``config`` is absent.
        model: the module to train (fp32 parameters).
        optimizer: a torch optimizer built over the model's parameters, or a callable taking
            param groups and returning one; mutually exclusive with the config's ``optimizer``.
        model_parameters: the parameters (or param-group dicts) to train; default: every
            parameter of ``model`` that requires grad.
        training_data: a dataset; a ``DataLoader`` with a ``DistributedSampler`` and the
            configured micro batch is returned for it.
        lr_scheduler: a scheduler instance over ``optimizer``, or a callable taking the optimizer.
        distributed_port: accepted for compatibility; the launcher's ``MASTER_PORT`` is used.
        mpu: model-parallel unit; not supported (a clear error).
        dist_init_required: accepted for compatibility; the process group is created when absent.
        collate_fn: collate function for the returned data loader.
        config: a path, dict, JSON string or :class:`ZeroshardConfig` in DeepSpeed's schema.
        mesh_param: DeepSpeed's device-mesh sizes; not supported (a clear error).
        config_params: DeepSpeed's older name for ``config``.
        auto_values: values for ``"auto"`` entries, keyed by dotted path
            (``{"optimizer.params.lr": 3e-4}``).
        **unknown: any other keyword is a ``TypeError`` naming it, with the closest valid name.

    Returns:
        ``(engine, optimizer, dataloader, lr_scheduler)``.
    """
    _reject_unknown_keywords(unknown)
    if model is None:
        raise ConfigError("initialize() needs model=...")
    if mpu is not None:
        raise NotYetSupportedError("model parallelism (mpu=...) is not supported", key="mpu")
    if mesh_param is not None:
        raise NotYetSupportedError("device meshes (mesh_param=...) for tensor/sequence parallelism are not supported",
                                   key="mesh_param")
    config = config if config is not None else config_params
    if config is None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        raise ConfigError("initialize() needs config=... (a path, dict or JSON string in DeepSpeed's schema)")
    install_default_handler()  # progress visible on stderr unless the application configured logging
    started = time.perf_counter()
    init_distributed()
    group = None  # the default (world) group: the one the user created, or ours
    cfg = load_config(config, world_size=C.world_size(group), auto_values=auto_values)
    refuse_shape_dependent(optimizer)  # before anything is moved or partitioned
    check_model(model, cfg.zero_stage, C.world_size(group), sixteen_bit=cfg.compute_dtype != torch.float32,
                warn=C.rank(group) == 0)
    logger.info("zeroshard: initialize: ZeRO stage %d on %d ranks", cfg.zero_stage, C.world_size(group))
    _check_same_config(cfg, group)
    _configure_activation_checkpointing(cfg)  # the activation_checkpointing block, unless configure() was called
    if cfg.collective_timeout is not None:
        watchdog.set_timeout(timedelta(seconds=float(cfg.collective_timeout)), group)
    watchdog.start_heartbeat()
    device = default_device(local_rank())
    model.to(device)
    # Built under zero.Init but trained unsharded: whole, on the training device (model.to above
    # moved only placeholders; with remote_device the chunks are in host memory).
    hybrid = _hybrid_shard_size(cfg, group)
    if cfg.zero_stage < 3 or hybrid:  # hybrid: zero.Init's chunks are the world's, the shards a group's
        materialize_init_params(model, group, device)
    _sync_module_states(model, group)

    cfg = _client_overrides(cfg, optimizer, lr_scheduler, group)
    # Without any optimizer the engine is for evaluation or inference, possibly of a model frozen
    # whole (TRL's reference model, a distillation teacher), as DeepSpeed builds it.
    trains = optimizer is not None or cfg.optimizer is not None
    param_groups = _param_groups(model, optimizer, model_parameters, need_trained=trains)
    if cfg.zero_stage == 3:
        _apply_leaf_module_config(model, cfg.zero_optimization.leaf_module)
        mark_fine_grained_leaves(model, cfg.zero_optimization.stage3_module_granularity_threshold)
        # ZeRO-3 partitions the parameters it trains and the frozen ones (requires_grad=False);
        # one outside the optimizer that requires gradients stays whole (it warns with the size).
        trained = {id(p) for g in param_groups for p in g["params"]}
        materialize_init_params(model, group, device, only=lambda p: id(p) not in trained and p.requires_grad)
    policy = PrecisionPolicy(
        param_dtype=cfg.compute_dtype,
        grad_accum_dtype=cfg.grad_accum_dtype,
        reduce_dtype=cfg.reduce_dtype,
        auto_cast=cfg.fp16.auto_cast if cfg.fp16.enabled else cfg.bf16.auto_cast,
    )
    z = cfg.zero_optimization
    spec = StageSpec(
        stage=cfg.zero_stage,
        reduce_bucket_size=_bucket_numel(z, "reduce_bucket_size"),
        allgather_bucket_size=_bucket_numel(z, "allgather_bucket_size"),
        overlap_comm=bool(z.overlap_comm),
        gradient_clipping=float(cfg.gradient_clipping),
        max_live_parameters=int(z.stage3_max_live_parameters),
        prefetch_bucket_size=int(z.stage3_prefetch_bucket_size),
        param_persistence_threshold=int(z.stage3_param_persistence_threshold),
        skip_non_finite=cfg.fp16.enabled or not cfg.bf16.enabled or bool(cfg.bf16.check_grad_overflow),
        quantized_weights=bool(z.zero_quantized_weights),
        quantized_gradients=bool(z.zero_quantized_gradients),
        hpz_partition_size=max(1, int(z.zero_hpz_partition_size)),
    )
    _note_default_clipping(cfg, group)
    if not spec.skip_non_finite and C.rank(group) == 0:
        logger.warning("zeroshard: bf16.check_grad_overflow is false: a step whose gradients hold NaN or Inf is "
                       "applied, as in DeepSpeed, and the parameters then hold NaN or Inf; remove the key to "
                       "skip such steps")
    scaler = make_loss_scaler(cfg.fp16)
    offload = OffloadPolicy.from_config(cfg)
    clock = StepClock()
    stage_group, replicate = make_hybrid_groups(device, hybrid) if hybrid else (group, None)
    zero_opt = build_stage(model, param_groups, spec, policy, scaler, stage_group, device, offload,
                           scaling=_reduce_scaling(cfg, C.world_size(group)), trains=trains, clock=clock,
                           observer=DEEPSPEED_PARAM_ATTRS, kinds=DEEPSPEED_STAGES, replicate=replicate)
    try:  # a failure from here on (a bad optimizer or scheduler, auto_resume) must not leave swap files behind
        if spec.stage == 3:
            add_external_parameters_accessor(model)  # DeepSpeed's module.ds_external_parameters()
        if policy.param_dtype != torch.float32:
            model.to(policy.param_dtype)
        zero_opt.note_parameter_data()
        _bind_optimizer(zero_opt, optimizer, cfg)
        scheduler = _scheduler(lr_scheduler, zero_opt, cfg)
        loader = _dataloader(training_data, cfg, collate_fn, group)
        engine = ZeroEngine(model, zero_opt, cfg, policy, scheduler, group, clock)
        engine.training_dataloader = loader
        engine.collate_fn = collate_fn  # deepspeed_io's default, as in DeepSpeed
        if cfg.checkpoint.auto_resume:
            path, _ = engine.load_checkpoint(cfg.checkpoint.auto_resume)
            if C.rank(group) == 0:
                logger.warning("zeroshard: %s", f"resumed from {path} at step {engine.global_steps}" if path else
                               f"auto_resume: no checkpoint in {cfg.checkpoint.auto_resume} yet, starting afresh")
    except BaseException:  # the hooks, swap files and I/O threads would stay until the interpreter exits
        zero_opt.detach()
        raise
    if C.rank(group) == 0:
        warn_no_effect(cfg)
        oo = cfg.zero_optimization.offload_optimizer
        if oo.ratio < 1.0 and oo.device == "none":  # DeepSpeed ignores it too
            logger.warning("zeroshard: zero_optimization.offload_optimizer.ratio = %r has no effect without "
                           'offload_optimizer.device "cpu": all of the optimizer state stays on the device', oo.ratio)
        if cfg.dump_state:  # DeepSpeed's dump_state: the engine's settings after initialization
            logger.info("zeroshard: dump_state: %s", json.dumps(to_dict(cfg), indent=2, sort_keys=True))
    n_trained = sum(full_numel(p) for p in zero_opt.master.views)
    logger.info("zeroshard: ZeRO stage %d, %s, world size %d, %d trainable parameters, initialized in %.1f s",
                spec.stage, policy.param_dtype, engine.world_size, n_trained, time.perf_counter() - started)
    return engine, zero_opt, loader, scheduler


def _hybrid_shard_size(cfg: ZeroshardConfig, group: dist.ProcessGroup | None) -> int:
    """``hybrid_shard_size`` when it splits the world into several groups, else 0 (sharding over all).

    Raises:
        ConfigError: the data-parallel group is not the whole world (the groups are the world's).
    """
    size = int(cfg.zero_optimization.hybrid_shard_size)
    world = C.world_size(group)
    if not size or size == world:
        return 0
    if group is not None and world != dist.get_world_size():
        raise ConfigError(f"hybrid_shard_size {size} needs the data-parallel group to be the whole world "
                          f"({dist.get_world_size()} ranks), not a group of {world}",
                          key="zero_optimization.hybrid_shard_size")
    return size


def _reduce_scaling(cfg: ZeroshardConfig, world: int) -> tuple[float, float] | None:
    """DeepSpeed's placement of the gradient average around the reduction: ``(pre, post)`` factors.

    ``prescale_gradients`` divides by the world size before the reduction; otherwise gradients are
    divided by ``gradient_predivide_factor`` before it and by ``world / factor`` after it (keeping
    16-bit sums in range). Both at their defaults: ``None``, the stage's own placement (stages 0-1
    divide as gradients are accumulated, stages 2-3 after each reduction), which only rounds
    differently. ``gradient_allreduce_op: "sum"`` divides by nothing, whatever the other two say.
    """
    if cfg.gradient_allreduce_op == "sum":
        return 1.0, 1.0
    if cfg.prescale_gradients:
        return 1.0 / world, 1.0
    factor = float(cfg.gradient_predivide_factor)
    if factor == 1.0:
        return None
    return 1.0 / factor, factor / world


def _reject_unknown_keywords(unknown: dict[str, Any]) -> None:
    """``initialize(**kwargs)`` takes DeepSpeed's keywords only: a typo is an error, not ignored."""
    if not unknown:
        return
    import difflib
    import inspect

    valid = [n for n, p in inspect.signature(initialize).parameters.items() if p.kind is not p.VAR_KEYWORD]
    name = sorted(unknown)[0]
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keywords: {', '.join(valid)}"
    raise TypeError(f"initialize() got an unexpected keyword argument {name!r}{hint}")


def _note_default_clipping(cfg: Any, group: Any) -> None:
    """Say once, on rank 0, that the global gradient norm is clipped although the config never asked.

    DeepSpeed 0.19's default ``gradient_clipping`` is 1.0, and we keep it so that a DeepSpeed config
    trains the same here. Plain PyTorch does not clip, so a user comparing against a PyTorch loop
    sees different gradients as soon as the norm exceeds 1 (issue 15 was exactly that).
    """
    if "gradient_clipping" in cfg.model_fields_set or cfg.gradient_clipping <= 0 or C.rank(group) != 0:
        return
    logger.warning("zeroshard: gradient_clipping is not set, so the global gradient norm is clipped at %g "
                   "(DeepSpeed's default); set \"gradient_clipping\": 0 in the config to train without clipping",
                   cfg.gradient_clipping)


#: Bucket size when the config does not set one. DeepSpeed's default of 5e8 elements makes a
#: single bucket of any model under 500M parameters, so no communication overlaps backward;
#: DDP's 25 MiB buckets do overlap, and the config's value stays an upper bound either way.
DEFAULT_BUCKET_BYTES = 25 * 2**20


def _bucket_numel(zero: Any, key: str) -> int:
    value = int(getattr(zero, key))
    if key in zero.model_fields_set:
        return value
    return min(value, DEFAULT_BUCKET_BYTES // 4)


def _check_same_config(cfg: ZeroshardConfig, group: dist.ProcessGroup | None) -> None:
    """Every rank must train with the same config: a different bucket size or stage on one rank
    would make collectives of different sizes meet (a hang or garbage), a different learning rate
    silently diverging replicas. One all-gather of a digest; the first differing key is named."""
    def flat(prefix: str, value: Any) -> list[str]:
        if isinstance(value, dict):
            return [line for k in sorted(value) for line in flat(f"{prefix}.{k}" if prefix else str(k), value[k])]
        return [f"{prefix} = {value!r}"]

    C.check_same_across_ranks(flat("", cfg.model_dump()), group, "config entries",
                              "Every rank must pass the same config to initialize().")


def _sync_module_states(model: torch.nn.Module, group: dist.ProcessGroup | None) -> None:
    """Check every rank built the same module, then broadcast rank 0's parameters and buffers."""
    entries = [f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in model.state_dict(keep_vars=True).items()]
    C.check_same_across_ranks(entries, group, "module parameters and buffers")
    with torch.no_grad():
        C.broadcast_coalesced([t.data for t in list(model.parameters()) + list(model.buffers())], src=0, group=group)


def _param_groups(model: torch.nn.Module, optimizer: OptimizerArg, model_parameters: Iterable[Any] | None,
                  need_trained: bool = True) -> list[dict[str, Any]]:
    """Normalise the trainable parameters into torch-style param groups over the module's params
    (none is an error when ``need_trained``)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = [dict(g) for g in optimizer.param_groups]
    elif model_parameters is not None:
        # As torch's optimizers take them: one tensor, tensors, (name, tensor) pairs, or groups.
        items = [model_parameters] if isinstance(model_parameters, torch.Tensor) else list(model_parameters)
        if items and isinstance(items[0], dict):
            groups = [dict(g) for g in items]
        else:
            groups = [{"params": items}]
    else:
        groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    owned = {id(p): name for name, p in model.named_parameters()}
    seen: set[int] = set()
    for i, g in enumerate(groups):
        params = [p for p in _tensors(g, i) if p.requires_grad]
        for p in params:
            if id(p) not in owned:
                raise ConfigError("a parameter passed to initialize() does not belong to the model",
                                  key="model_parameters")
            if id(p) in seen:
                raise ConfigError(f"parameter '{owned[id(p)]}' appears in more than one param group",
                                  key="model_parameters")
            seen.add(id(p))
        g["params"] = params
    if not seen and need_trained:
        raise ConfigError("no trainable parameters (none requires grad)", key="model_parameters")
    return [g for g in groups if g["params"]]


def _tensors(group: dict[str, Any], index: int) -> list[torch.Tensor]:
    """A param group's tensors, taking names off ``(name, tensor)`` pairs (``named_parameters()``)."""
    if "params" not in group:
        raise ConfigError(f"param group {index} has no 'params' key (got keys {sorted(group)})", key="model_parameters")
    items = group["params"]
    items = [items] if isinstance(items, torch.Tensor) else list(items)
    out = []
    for item in items:
        if (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            item = item[1]
        if not isinstance(item, torch.Tensor):
            raise ConfigError("model_parameters must hold parameters, (name, parameter) pairs or param group "
                              f"dicts; param group {index} holds a {type(item).__name__}", key="model_parameters")
        out.append(item)
    return out


def _bind_optimizer(zero_opt: ZeroOptimizer, optimizer: OptimizerArg, cfg: ZeroshardConfig) -> None:
    if isinstance(optimizer, torch.optim.Optimizer):
        zero_opt.adopt(optimizer)
    elif callable(optimizer):
        try:
            zero_opt.bind(optimizer)
        except (ZeroshardError, torch.OutOfMemoryError):
            raise  # already says what it is; callers and retry helpers match on the type
        except (ValueError, TypeError, RuntimeError) as e:
            raise ConfigError(f"the optimizer factory passed to initialize failed: {type(e).__name__}: {e} (its param "
                              "groups hold flat 1-D views of each rank's shard: an optimizer that needs the "
                              "parameters' shapes cannot step them)", key="optimizer") from e
        refuse_shape_dependent(zero_opt.optimizer)  # a factory: known only once it has built one
    elif cfg.optimizer is not None:
        opt_cfg = cfg.optimizer
        zero_opt.bind(lambda groups: build_optimizer(opt_cfg.type, dict(opt_cfg.params), groups))
    else:
        logger.info("zeroshard: no optimizer in the config or the arguments: an engine for evaluation and "
                    "inference (engine.step() raises)")
        zero_opt.bind(NoOptimizer)


def _client_overrides(cfg: ZeroshardConfig, optimizer: OptimizerArg, lr_scheduler: Any,
                      group: dist.ProcessGroup | None) -> ZeroshardConfig:
    """An optimizer or scheduler passed to ``initialize`` is used, and the config's block of the same
    kind dropped, as DeepSpeed does (its GAN example passes both); rank 0 says which block is unused."""
    unused = [key for key, client in (("optimizer", optimizer), ("scheduler", lr_scheduler))
              if client is not None and getattr(cfg, key) is not None]
    for key in unused:
        if C.rank(group) == 0:
            logger.warning("zeroshard: the config's %r block (type %s) is not used: initialize(%s=...) was given, "
                           "and it is the one used, as in DeepSpeed", key, getattr(cfg, key).type,
                           "lr_scheduler" if key == "scheduler" else key)
    return cfg.model_copy(update=dict.fromkeys(unused)) if unused else cfg


def _scheduler(lr_scheduler: Any, zero_opt: ZeroOptimizer, cfg: ZeroshardConfig) -> Any:
    inner = zero_opt.optimizer
    if isinstance(inner, NoOptimizer):  # as DeepSpeed: no optimizer, no scheduler (transformers'
        return None                      # evaluation engine keeps the config's scheduler block)
    if lr_scheduler is not None:
        return lr_scheduler(inner) if callable(lr_scheduler) and not hasattr(lr_scheduler, "step") else lr_scheduler
    if cfg.scheduler is not None:
        return build_scheduler(cfg.scheduler.type, dict(cfg.scheduler.params), inner)
    return None


def _dataloader(data: Any, cfg: ZeroshardConfig, collate_fn: Callable[..., Any] | None,
                group: dist.ProcessGroup | None) -> torch.utils.data.DataLoader | None:
    if data is None:
        return None
    if not isinstance(data, torch.utils.data.Dataset) and not hasattr(data, "__getitem__"):
        raise ConfigError(f"training_data must be a dataset (a torch Dataset or a sequence of samples), got a "
                          f"{type(data).__name__}; pass a DataLoader you build yourself to your loop instead",
                          key="training_data")
    if isinstance(data, torch.utils.data.IterableDataset):
        raise ConfigError("training_data is an IterableDataset, which has no indices to shard among ranks "
                          "(DeepSpeed fails on it too); shard it yourself and iterate it in your loop",
                          key="training_data")
    # Resumable: same batches as DistributedSampler (which also pads the ranks' shares to equal
    # length, as DeepSpeed's loader does), and a position that checkpoints save/restore.
    from zeroshard.checkpoint.dataloader import ResumableDataLoader, ResumableDistributedSampler

    sampler = ResumableDistributedSampler(data, num_replicas=C.world_size(group), rank=C.rank(group), shuffle=True)
    micro = cfg.train_micro_batch_size_per_gpu
    assert micro is not None  # resolved by load_config
    return ResumableDataLoader(data, batch_size=micro, sampler=sampler, collate_fn=collate_fn,
                               drop_last=bool(cfg.dataloader_drop_last))


def _apply_leaf_module_config(model: torch.nn.Module, leaf: LeafModuleConfig) -> list[torch.nn.Module]:
    """Mark the ZeRO-3 leaves the ``zero_optimization.leaf_module`` block names (``leaf.classes``,
    ``leaf.names`` as in ``named_modules()``, ``leaf.name_suffixes``); warn about names and classes
    that match nothing, unless the classes are DeepSpeed's defaults (most models have none of them)."""
    marked = {id(m): m for m in set_z3_leaf_modules(model, leaf.classes, raise_if_not_found=False)}
    by_name, missing_names = set_z3_leaf_modules_by_name(model, leaf.names, raise_if_not_found=False)
    by_suffix, missing_suffixes = set_z3_leaf_modules_by_suffix(model, leaf.name_suffixes, raise_if_not_found=False)
    for m in by_name + by_suffix:
        marked.setdefault(id(m), m)
    unmatched = missing_names + missing_suffixes
    if unmatched:
        logger.warning("zeroshard: zero_optimization.leaf_module: no module named %s", unmatched)
    if not marked and tuple(leaf.classes) != DEFAULT_LEAF_MODULE_CLASSES:
        logger.warning("zeroshard: zero_optimization.leaf_module: no module of the classes %s", leaf.classes)
    return list(marked.values())
