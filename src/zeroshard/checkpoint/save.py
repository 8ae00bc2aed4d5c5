"""``engine.save_checkpoint``: every rank writes its shard in parallel, rank 0 publishes.

Sequence (see :mod:`zeroshard.checkpoint.atomic` for why each step is crash-safe):

1. All ranks agree on the tag and a random nonce; rank 0 creates ``save_dir/.tmp-<tag>-<nonce>``.
2. Every rank streams its pieces (fp32 masters, optimizer state, frozen parameters) and RNG state into its own
   ``rank-*.safetensors`` and fsyncs it; rank 0 also writes ``extra.safetensors``.
3. The file sizes are gathered (a barrier); rank 0 writes ``zeroshard.json`` and then the
   ``COMPLETE`` marker, renames the directory to ``save_dir/<tag>``, and replaces ``latest``.
4. Rank 0's outcome is broadcast, so every rank returns (or raises) together.

A failure on any rank (a full disk, an unserializable ``client_state``) is raised on every rank
instead of leaving the others blocked in a collective; the temporary directory is removed. A
successful save also removes what interrupted saves of the same tag left behind.
"""

from __future__ import annotations

import functools
import json
import logging
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zeroshard import __version__
from zeroshard.checkpoint import collect
from zeroshard.checkpoint.agree import together as _together
from zeroshard.checkpoint.atomic import TMP_PREFIX, fault_point, publish_dir, write_file_atomic, write_file_durable
from zeroshard.checkpoint.jsonable import TensorTable, encode
from zeroshard.checkpoint.metadata import (
    EXTRA_FILE,
    CheckpointMeta,
    ParamMeta,
    Piece,
    frozen_key,
    master_key,
    optim_key,
    rank_file,
)
from zeroshard.checkpoint.paths import LATEST_FILE, MARKER_FILE, META_FILE, marker_text
from zeroshard.checkpoint.rng import capture_rng
from zeroshard.checkpoint.safetensors_io import TensorSpec, write_safetensors
from zeroshard.checkpoint.tags import agree_on_tag, check_tag, write_recovery_script
from zeroshard.core.comm import collectives as C
from zeroshard.errors import ConfigError

logger = logging.getLogger("zeroshard")


def _nonce(group: dist.ProcessGroup | None) -> str:
    value = torch.tensor([secrets.randbits(62)], dtype=torch.int64, device=C.control_device(group))
    C.broadcast(value, src=0, group=group)  # every rank uses rank 0's
    return f"{int(value.item()) & 0xFFFFFFFF:08x}"


def _master_piece(store: Any, tp: collect.TrainedParam, s: int, e: int) -> torch.Tensor:
    return store.master_values(tp.master)[s - tp.lo : e - tp.lo]  # type: ignore[no-any-return]


def _write_rank_file(path: Path, trained: list[collect.TrainedParam], frozen: list[collect.FrozenParam],
                     kinds: dict[str, dict[str, str]], store: Any, rank: int, world: int) -> int:
    """Stream this rank's pieces. Each parameter's master and state come from the state store
    when they are written (read from swap files with NVMe offload), one parameter at a time; so do
    the frozen parameters' pieces (from the ZeRO-3 frozen shard, or the module)."""
    specs: list[TensorSpec] = []
    fetch: dict[str, Callable[[], torch.Tensor]] = {}
    last: dict[str, Any] = {"master": None, "state": {}}  # the parameter whose entries are being written

    def state_of(tp: collect.TrainedParam) -> dict[str, Any]:
        if last["master"] is not tp.master:
            last["master"], last["state"] = tp.master, store.state(tp.master)
        return last["state"]  # type: ignore[no-any-return]

    for tp in trained:
        s, e = tp.save_range(rank, world)
        if e <= s:
            continue
        specs.append(TensorSpec(master_key(tp.name), torch.float32, (e - s,)))
        fetch[master_key(tp.name)] = functools.partial(_master_piece, store, tp, s, e)
        meta_state = store.state_meta(tp.master)  # shapes and dtypes; scalars are real
        for key, kind in kinds[tp.name].items():
            if kind == collect.SHARDED:
                specs.append(TensorSpec(optim_key(key, tp.name), meta_state[key].dtype, (e - s,)))
            else:
                piece = collect.state_piece(meta_state[key], kind, tp.lo, s, e)
                specs.append(TensorSpec(optim_key(key, tp.name), piece.dtype, tuple(piece.shape)))
            fetch[optim_key(key, tp.name)] = functools.partial(
                lambda tp, key, kind, s, e: collect.state_piece(state_of(tp)[key], kind, tp.lo, s, e),
                tp, key, kind, s, e)
    for fp in frozen:
        s, e = fp.save_range(rank, world)
        if e > s:
            specs.append(TensorSpec(frozen_key(fp.name), fp.dtype, (e - s,)))
            fetch[frozen_key(fp.name)] = functools.partial(fp.values, s, e)
    rng_tensors, rng_record = capture_rng()
    for k, t in rng_tensors.items():
        specs.append(TensorSpec(k, t.dtype, tuple(t.shape)))
        fetch[k] = functools.partial(rng_tensors.__getitem__, k)
    meta = {"format": "zeroshard", "rank": str(rank), "world_size": str(world), "rng": json.dumps(rng_record)}
    return write_safetensors(path, specs, lambda spec: fetch[spec.name](), meta,
                             after_each=lambda i: fault_point("shard_partial", rank) if i == 0 else None,
                             checksums=True)


def _write_extra(path: Path, layout: dict[str, Any], table: TensorTable) -> int:
    sources = {f"buffer/{k}": v for k, v in layout["buffers"].items()}
    sources.update(table.tensors)
    specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in sources.items()]
    return write_safetensors(path, specs, lambda spec: sources[spec.name], {"format": "zeroshard"}, checksums=True)


def _describe(engine: Any, tag: str, world: int, trained: list[collect.TrainedParam],
              frozen: list[collect.FrozenParam], kinds: dict[str, dict[str, str]], layout: dict[str, Any],
              client_state: Any, table: TensorTable) -> CheckpointMeta:
    """Rank 0: everything but the file sizes, JSON-encoded (user input is validated here)."""
    opt = engine.optimizer.optimizer
    params = [ParamMeta(tp.name, list(tp.shape), tp.group,
                        [Piece(rank_file(r, world), s, e) for r, s, e in tp.pieces(world)], kinds[tp.name])
              for tp in trained]
    frozen_params = [ParamMeta(fp.name, list(fp.shape), 0, [Piece(rank_file(r, world), s, e)
                                                          for r, s, e in fp.pieces(world)]) for fp in frozen]
    sched = engine.lr_scheduler
    loader: Any = getattr(engine, "training_dataloader", None)
    scaler = engine.optimizer.scaler
    return CheckpointMeta(
        tag=tag, world_size=world, zero_stage=int(engine.zero_optimization_stage()),
        compute_dtype=str(engine.policy.param_dtype).replace("torch.", ""), params=params, files={},
        module_keys=layout["module_keys"], aliases=layout["aliases"], buffers=list(layout["buffers"]),
        frozen=[], frozen_params=frozen_params, optimizer_type=type(opt).__name__,
        param_groups=encode(collect.group_options(opt), table, "optimizer param_groups"),
        lr_scheduler=None if sched is None else encode(sched.state_dict(), table, "lr_scheduler.state_dict()"),
        loss_scaler={"dynamic": bool(getattr(scaler, "dynamic", False)), **scaler.state_dict()},
        counters={"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                  "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps},
        dataloader=loader.state_dict() if hasattr(loader, "state_dict") else None,
        client_state=encode(client_state, table, "client_state"),
        versions={"zeroshard": __version__, "torch": torch.__version__},
        gradient_clipping=float(engine.config.gradient_clipping),
    )


def save_checkpoint(engine: Any, save_dir: str | Path, tag: str | None = None, client_state: Any = None,
                    save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
    """Save ``engine`` to ``save_dir/<tag>`` (collective: call on every rank). See the module doc."""
    if not save_dir:  # "" would save into the working directory, None fail deep in pathlib: DeepSpeed refuses both
        raise ConfigError(f"save_checkpoint needs a non-empty directory path, got {save_dir!r}", key="save_dir")
    group = engine.group
    rank, world = C.rank(group), C.world_size(group)
    wanted = agree_on_tag(str(tag) if tag is not None else f"global_step{engine.global_steps}", group,
                          engine.config.checkpoint.tag_validation)  # DeepSpeed's Warn/Ignore/Fail
    tag = _together(lambda: check_tag(wanted, Path(save_dir), save_latest), group, "checking the checkpoint tag")
    C.check_same_across_ranks([tag, str(save_dir)], group, "save_checkpoint tag and directory",
                              hint="Every rank must pass the same directory (one all ranks can reach) and tag.")
    if engine.micro_steps % engine.gradient_accumulation_steps():
        logger.warning("saving checkpoint %s in the middle of a gradient accumulation window: the gradients "
                       "accumulated so far are not saved", tag)
    root = Path(save_dir)
    tmp = root / f"{TMP_PREFIX}{tag}-{_nonce(group)}"
    started = time.perf_counter()
    if rank == 0:
        logger.info("saving checkpoint %s from %d ranks", root / tag, world)
    engine.optimizer.rebind_parameters()  # a parameter whose .data user code replaced: its new values
    trained = collect.trained_params(engine)
    frozen = [] if exclude_frozen_parameters else collect.frozen_params(engine, trained)
    table = TensorTable("meta/")

    def prepare() -> tuple[dict[str, dict[str, str]], dict[str, Any], CheckpointMeta | None]:
        store = engine.optimizer.store
        kinds = {tp.name: collect.state_kinds(store.state_meta(tp.master), tp.master, tp.name) for tp in trained}
        if rank != 0:
            return kinds, {}, None
        with C.on_ranks([0], "preparing the checkpoint, which runs on rank 0 only", group):
            layout = collect.module_layout(engine)  # gathers nothing
            meta = _describe(engine, tag, world, trained, frozen, kinds, layout,
                             {} if client_state is None else client_state, table)
            root.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
        return kinds, layout, meta

    prepared = _together(prepare, group, "preparing the checkpoint")
    assert prepared is not None
    kinds, layout, meta = prepared
    fault_point("begin", rank)
    try:
        def write() -> int:
            # Hybrid sharding: the pieces of a sharded parameter are named by the rank in its group,
            # which is the global rank in the first group (consecutive ranks); the other groups hold
            # copies and write only what every rank writes (RNG, parameters split over the world).
            mine = engine.optimizer.replica == 0
            size = _write_rank_file(tmp / rank_file(rank, world),
                                    [tp for tp in trained if mine or tp.layout_world == 1],
                                    [fp for fp in frozen if mine or fp.layout_world == 1], kinds,
                                    engine.optimizer.store, rank, world)
            if rank == 0:
                assert meta is not None
                with C.on_ranks([0], "writing the checkpoint's extra file, which runs on rank 0 only", group):
                    meta.files[EXTRA_FILE] = _write_extra(tmp / EXTRA_FILE, layout, table)
            fault_point("shard_written", rank)
            return size

        sizes = torch.zeros(world, dtype=torch.int64, device=C.control_device(group))
        sizes[rank] = int(_together(write, group, "writing the shard files") or 0)
        C.all_reduce(sizes, group, async_op=False)

        def publish() -> None:
            if meta is not None:
                with C.on_ranks([0], "publishing the checkpoint, which runs on rank 0 only", group):
                    meta.files.update({rank_file(r, world): int(sizes[r]) for r in range(world)})
                    _publish(meta, tmp, root, tag, save_latest)

        _together(publish, group, "publishing the checkpoint")
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if rank == 0:
        logger.info("saved checkpoint %s: %.1f MiB of shards in %.1f s", root / tag, int(sizes.sum()) / 2**20,
                    time.perf_counter() - started)
    return True


def _publish(meta: CheckpointMeta, tmp: Path, root: Path, tag: str, save_latest: bool) -> None:
    """Rank 0: metadata, then the marker, then the rename, then ``latest``; each durable before the next."""
    raw = meta.to_bytes()
    write_file_durable(tmp / META_FILE, raw)
    fault_point("meta_written", 0)
    write_file_durable(tmp / MARKER_FILE, marker_text(raw).encode())
    fault_point("marker_written", 0)
    publish_dir(tmp, root / tag)
    fault_point("renamed", 0)
    _remove_leftovers(root, tag)
    write_recovery_script(root)  # DeepSpeed leaves zero_to_fp32.py beside its checkpoints too
    if save_latest:
        write_file_atomic(root / LATEST_FILE, tag.encode(), rank=0, fault="latest_partial")
    fault_point("done", 0)


def _remove_leftovers(root: Path, tag: str) -> None:
    """Delete what earlier interrupted saves of this tag (and of ``latest``) left behind."""
    for stale in root.glob(f"{TMP_PREFIX}{tag}-*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob(f"{TMP_PREFIX}{LATEST_FILE}-*"):
        if stale.is_file():
            stale.unlink(missing_ok=True)
