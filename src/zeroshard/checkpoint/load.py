"""``engine.load_checkpoint``: each rank reads the ranges it owns, from either format, any world size.

For every trained parameter the rank owns the elements ``[lo, hi)`` of the flattened value (its
stage's chunk, or everything at stage 0); it reads exactly that range of the fp32 master and of
each sharded optimizer-state entry from the files that hold it, then the stage re-publishes the
module parameters from the masters. Nothing is gathered, so memory stays at one shard.
Semantics follow DeepSpeed's ``load_checkpoint``: ``load_module_only`` restores weights alone;
otherwise optimizer state, loss scaler, LR scheduler and step counters follow the flags, and
zeroshard also restores each rank's RNG state and the data loader's position.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from zeroshard.checkpoint import collect
from zeroshard.checkpoint.agree import together
from zeroshard.checkpoint.open import open_source
from zeroshard.checkpoint.paths import resolve_checkpoint
from zeroshard.checkpoint.rng import restore_rng
from zeroshard.checkpoint.source import MASTER, CheckpointSource
from zeroshard.core.comm import collectives as C
from zeroshard.errors import CheckpointError

logger = logging.getLogger("zeroshard")


def _restore(src: CheckpointSource, what: str, load: Callable[[], None]) -> None:
    """Hand saved state to its owner's ``load_state_dict``; what the owner rejects (a damaged or
    forged checkpoint) is raised as a :class:`CheckpointError` naming the checkpoint."""
    try:
        load()
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError, RuntimeError) as e:
        raise CheckpointError(f"{src.path}: cannot restore {what}: {type(e).__name__}: {e}") from e


def _check_shape(src: CheckpointSource, name: str, stored: tuple[int, ...], live: tuple[int, ...]) -> None:
    if stored != live:
        raise CheckpointError(f"{src.path}: {name!r} has shape {stored} in the checkpoint and {live} in the model")


def _check_names(src: CheckpointSource, trained: list[collect.TrainedParam], strict: bool) -> None:
    live = {tp.name: tp for tp in trained}
    stored = set(src.params) | set(src.frozen)
    missing = [n for n in live if n not in stored]
    unexpected = [n for n in src.params if n not in live]
    for n, tp in live.items():
        if n in src.params:
            _check_shape(src, n, tuple(src.params[n].shape), tuple(tp.shape))
    if strict and (missing or unexpected):
        raise CheckpointError(f"{src.path} does not match the model (load_module_strict=True): missing "
                              f"{missing or 'none'}, unexpected {unexpected or 'none'}")


def _load_weights(src: CheckpointSource, engine: Any, trained: list[collect.TrainedParam], strict: bool) -> None:
    with torch.no_grad():
        store = engine.optimizer.store  # masters may live on the device, in host memory or in a file
        for tp in trained:
            if tp.name in src.params:
                store.write_master(tp.master, src.read(MASTER, tp.name, tp.lo, tp.hi))
            elif tp.name in src.frozen:  # frozen when saved, trained now
                _check_shape(src, tp.name, src.frozen_shape(tp.name), tp.shape)
                store.write_master(tp.master, src.read_frozen(tp.name, tp.lo, tp.hi))
        frozen = collect.frozen_params(engine, trained)
        state = collect.module_state(engine)  # names and buffers only: nothing to gather
        names = {n for n, _ in engine.module.named_parameters(remove_duplicate=False)}
        buffers = {k: v for k, v in state.items() if k not in names and isinstance(v, torch.Tensor)}
        stored = set(src.buffers) | set(src.frozen) | set(src.params)
        missing = [n for n in [*(fp.name for fp in frozen), *buffers] if n not in stored]
        if strict and missing:
            raise CheckpointError(f"{src.path} lacks buffers/frozen parameters {missing} (load_module_strict=True)")
        for fp in frozen:
            if fp.name in src.params:  # trained when saved, frozen now
                _check_shape(src, fp.name, tuple(src.params[fp.name].shape), fp.shape)
                values = src.read(MASTER, fp.name, fp.lo, fp.hi)
            elif fp.name in src.frozen:
                _check_shape(src, fp.name, src.frozen_shape(fp.name), fp.shape)
                values = src.read_frozen(fp.name, fp.lo, fp.hi)
            else:
                continue
            if fp.owner is not None:  # ZeRO-3: this rank's chunk
                fp.owner.write(fp.param, values)
            else:
                fp.param.data.copy_(values.view(fp.shape))
        for n, t in buffers.items():
            if n in stored:
                value = src.read_full(n)
                _check_shape(src, n, tuple(value.shape), tuple(t.shape))
                t.data.copy_(value)


def _load_optimizer(src: CheckpointSource, engine: Any, trained: list[collect.TrainedParam]) -> None:
    opt = engine.optimizer.optimizer
    if src.param_groups is not None and len(src.param_groups) != len(opt.param_groups):
        raise CheckpointError(f"{src.path} has {len(src.param_groups)} optimizer param groups, the optimizer "
                              f"{len(opt.param_groups)}")
    index = {id(m): i for i, m in enumerate(m for g in opt.param_groups for m in g["params"])}
    store = engine.optimizer.store
    # Scalars (``step``) go through the optimizer's load_state_dict; per-element entries are
    # written through the store afterwards, one parameter at a time (to its swap file with NVMe
    # offload), so the whole state is never held twice.
    scalars: dict[int, dict[str, Any]] = {}
    # A parameter with no elements has no piece in any file, so no saved state: it starts afresh,
    # which changes no value (Adam's step count scales nothing there).
    stored = {name: sp for name, sp in src.params.items() if sp.numel}
    for tp in trained:
        sp = stored.get(tp.name)
        if sp is not None:
            st = {key: src.read_scalar(key, tp.name) for key, kind in sp.state.items() if kind != collect.SHARDED}
            if sp.state:
                scalars[index[id(tp.master)]] = st
    current = opt.state_dict()
    groups = []
    for i, g in enumerate(current["param_groups"]):
        saved = src.param_groups[i] if src.param_groups is not None else {}
        groups.append({**g, **{k: v for k, v in saved.items() if k not in collect.IMPLEMENTATION_KEYS}})
    _restore(src, "the optimizer state", lambda: store.load_states(scalars, groups))
    for tp in trained:
        sp = stored.get(tp.name)
        for key, kind in (sp.state.items() if sp is not None else ()):
            if kind == collect.SHARDED:
                store.write_state(tp.master, key, src.read(key, tp.name, tp.lo, tp.hi))
    scaler, saved_scaler = engine.optimizer.scaler, src.loss_scaler
    if saved_scaler is not None:
        if bool(saved_scaler.get("dynamic")) == bool(getattr(scaler, "dynamic", False)):
            _restore(src, "the loss scaler", lambda: scaler.load_state_dict(saved_scaler))
        else:
            logger.warning("loss scaler not restored: the checkpoint's is %s, this engine's is %s",
                           "dynamic" if saved_scaler.get("dynamic") else "static",
                           "dynamic" if scaler.dynamic else "static")


def _load_training_state(src: CheckpointSource, engine: Any, load_lr_scheduler_states: bool) -> None:
    if load_lr_scheduler_states and engine.lr_scheduler is not None and src.lr_scheduler is not None:
        _restore(src, "the LR scheduler", lambda: engine.lr_scheduler.load_state_dict(src.lr_scheduler))
    c = src.counters
    engine.global_steps = int(c.get("global_steps", 0))
    engine.global_samples = int(c.get("global_samples", engine.global_steps * engine.train_batch_size()))
    # Re-derived, never restored: the saved count is in the old run's micro-steps (it depends on its
    # world size and accumulation steps), and a partly accumulated window is not saved anyway, so
    # the resumed run starts a whole window at the boundary of its own accumulation steps.
    engine.window.recount_from_steps()
    engine.skipped_steps = int(c.get("skipped_steps", 0))
    rng = src.rng(C.rank(engine.group))
    if rng is not None:
        _restore(src, "the RNG state", lambda: restore_rng(*rng))
    loader: Any = getattr(engine, "training_dataloader", None)
    if src.dataloader is not None and hasattr(loader, "load_state_dict"):
        _restore(src, "the data loader position", lambda: loader.load_state_dict(src.dataloader))


def load_checkpoint(engine: Any, load_dir: str | Path, tag: str | None = None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False) -> tuple[str | None, dict[str, Any] | None]:
    """Load a zeroshard or DeepSpeed checkpoint into ``engine`` (collective). See the module doc.

    Returns:
        ``(path of the tag directory, client_state)``, or ``(None, None)`` when ``tag`` is not given
        and ``load_dir`` has no ``latest`` file (DeepSpeed's behaviour).
    """
    group = engine.group
    started = time.perf_counter()
    path = together(lambda: resolve_checkpoint(load_dir, tag), group, "finding the checkpoint")
    if path is None:
        if not Path(load_dir).exists():
            logger.warning("checkpoint directory %s does not exist: nothing loaded, training starts from "
                           "scratch (as DeepSpeed does)", load_dir)
        else:
            logger.warning("no 'latest' file in %s and no tag given: nothing loaded", load_dir)
        return None, None
    if C.rank(group) == 0:
        logger.info("loading checkpoint %s", path)
    src = together(lambda: open_source(path), group, f"opening {path}")
    try:
        trained = collect.trained_params(engine)

        def read_weights() -> None:
            _check_names(src, trained, load_module_strict)
            _load_weights(src, engine, trained, load_module_strict)

        together(read_weights, group, f"reading the weights of {path}")
        engine.optimizer.publish()
        if not load_module_only:
            if load_optimizer_states:
                together(lambda: _load_optimizer(src, engine, trained), group, f"reading the optimizer state of {path}")
            together(lambda: _load_training_state(src, engine, load_lr_scheduler_states), group,
                     f"restoring the training state of {path}")
        client_state = dict(src.client_state)
    finally:
        src.close()
    C.barrier(group)
    if C.rank(group) == 0 and logger.isEnabledFor(logging.INFO):
        size = sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())
        logger.info("loaded checkpoint %s (%s format, saved by %d ranks at stage %d): %.1f MiB in %.1f s", path,
                    src.format, src.world_size, src.zero_stage, size / 2**20, time.perf_counter() - started)
    return str(path), client_state
