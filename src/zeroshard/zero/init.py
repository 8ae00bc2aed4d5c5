"""``zeroshard.zero.Init``: build a model already partitioned, one parameter at a time.

Inside the context every parameter registered on any module becomes a :class:`LazyShardTensor`
(through torch's public parameter-registration hook, removed on exit; nothing in torch is
patched). On exit each becomes an ordinary ``nn.Parameter`` with an empty placeholder and this
rank's chunk attached, which ``initialize`` with ZeRO stage 3 adopts without ever materializing
the whole model; other stages gather the chunks back into full parameters.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import weakref
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_parameter_registration_hook

from zeroshard.config.load import read_config
from zeroshard.core import host_memory
from zeroshard.core.comm import collectives as C
from zeroshard.core.partition import INIT_CHUNK_ATTR as SHARD_ATTR
from zeroshard.core.partition import SHAPE_ATTR, ShardLayout, full_shape
from zeroshard.errors import ConfigError
from zeroshard.zero.lazy_shard import InitSession, LazyShardTensor, ShardCore
from zeroshard.zero.param_status import ZeroParamStatus

logger = logging.getLogger("zeroshard")



class Init:
    """Partition parameters as modules are constructed (DeepSpeed's ``zero.Init``).

    Args:
        module: accepted for DeepSpeed compatibility (an already-built module is not re-partitioned).
        data_parallel_group: the group to partition over (default: the world).
        remote_device: ``None``/``"cuda"`` (chunks where the module is built), ``"cpu"`` or
            ``"nvme"`` (chunks in host memory; ``initialize`` then moves them where the config's
            ``offload_param`` says, into the swap file for ``nvme``).
        pin_memory: accepted (pinning is decided by the config's ``offload_param.pin_memory``).
        config_dict_or_path: the training config (``config`` is DeepSpeed's older name). When it
            enables fp16 or bf16 (``true``, not ``"auto"``), the chunks are kept in that dtype, as
            DeepSpeed's are: half the memory while building, and the masters ``initialize`` makes
            start from the 16-bit values.
        enabled: ``False`` builds the model normally.
        dtype: dtype of the parameters' chunks (default: the config's 16-bit dtype, else as
            constructed; without a config DeepSpeed uses fp16, zeroshard keeps the constructed dtype).
    """

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group: dist.ProcessGroup | None = None,
                 remote_device: str | None = None, pin_memory: bool = False, config_dict_or_path: Any = None,
                 config: Any = None, enabled: bool = True, dtype: torch.dtype | None = None,
                 **deepspeed_only: Any) -> None:
        if remote_device not in (None, "cuda", "cpu", "nvme"):
            raise ConfigError(f"zero.Init(remote_device={remote_device!r}): expected None, 'cuda', 'cpu' or "
                              "'nvme'", key="remote_device")
        #: "cpu"/"nvme": chunks are kept in host memory until ``initialize`` places them by the
        #: config's offload_param (in the swap file for nvme)
        self.remote = remote_device in ("cpu", "nvme")
        self.enabled = enabled
        self.group = data_parallel_group
        cfg = config_dict_or_path if config_dict_or_path is not None else config
        self.dtype = dtype if dtype is not None else _config_dtype(cfg)
        #: ``remote_device="nvme"`` with the config's ``offload_param.nvme_path``: the chunks are
        #: written to file-backed buffers there as they are made, and leave the process's memory
        self.spill_dir = _nvme_path(cfg) if remote_device == "nvme" else None
        self._handle: Any = None
        self._session: InitSession | None = None
        self._created: list[tuple[torch.nn.Module, str]] = []
        #: a nested block: the outermost block open when this one began, and where its parameters start
        self._outer: Init | None = None
        self._first = 0
        #: inside ``initialize`` (see :func:`outside_init`): new parameters are left as they are
        self._paused = False
        #: parameters and elements settled so far (for the closing log line)
        self._settled = [0, 0]
        #: after the block: most bytes of parameter values this rank held at once while building
        self.peak_bytes = 0

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        from zeroshard.core.comm.groups import init_distributed

        init_distributed()
        if _OPEN:
            # Nested (a model whose constructor builds a sub-model under its own zero.Init, as
            # transformers' composite models do): the outermost block keeps partitioning; this
            # one only settles, on exit, the parameters created while it was open.
            self._outer = _OPEN[0]
            self._first = len(self._outer._created)
            return self
        self._session = InitSession(self.group, self.spill_dir)
        self._handle = register_module_parameter_registration_hook(self._on_register)
        _OPEN.append(self)
        return self

    def _on_register(self, module: torch.nn.Module, name: str, param: torch.nn.Parameter) -> Any:
        if self._paused:
            return None
        self._created.append((module, name))
        # already lazy (a parameter registered on a second module), or without values yet
        # (torch.nn.utils.skip_init's meta device: partitioned when settled)
        if param is None or isinstance(param, LazyShardTensor) or param.device.type == "meta":
            return None
        return self._lazy(param)

    def _lazy(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        """``param`` as a lazily partitioned parameter (a collective: rank 0's values are kept)."""
        assert self._session is not None
        data = param.detach()
        if self.remote and data.device.type != "cpu":
            data = data.to("cpu")
        if self.dtype is not None and data.is_floating_point():
            data = data.to(self.dtype)
        core = ShardCore(data, self._session)
        return torch.nn.Parameter(LazyShardTensor(core), requires_grad=param.requires_grad)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self.enabled:
            return
        if self._outer is not None:
            self._outer.settle(self._first)
            return
        self._handle.remove()
        _OPEN.remove(self)
        assert self._session is not None
        self.settle()
        self._session.close()
        self.peak_bytes = self._session.peak_bytes
        logger.info("zero.Init: %d parameters (%d elements) partitioned over %d ranks",
                    self._settled[0], self._settled[1], self._session.world)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Settle the parameters created so far, and partition nothing new inside the ``with``."""
        self.settle()
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def settle(self, first: int = 0) -> list[torch.nn.Parameter]:
        """Turn the parameters created since the ``first``-th into partitioned parameters
        (an empty placeholder with this rank's chunk and DeepSpeed's ``ds_*`` attributes), as the
        end of the block does; later parameters are still partitioned as they are registered.

        A collective: every rank settles at the same point (the end of a nested block, or
        ``initialize`` called inside the block). Returns the parameters it converted.
        """
        assert self._session is not None
        self._session.flush()  # every cached full parameter back to its chunk
        converted: dict[int, torch.nn.Parameter] = {}
        made: dict[int, torch.nn.Parameter] = {}  # a tied parameter is partitioned once
        for module, name in self._created[first:]:
            whole = module._parameters.get(name)
            if (whole is not None and not isinstance(whole, LazyShardTensor) and whole.device.type != "meta"
                    and getattr(whole, SHARD_ATTR, None) is None):
                # built on the meta device, then given values in the block (skip_init's to_empty)
                if id(whole) not in made:
                    made[id(whole)] = self._lazy(whole)
                module._parameters[name] = made[id(whole)]
            lazy = module._parameters.get(name)
            if not isinstance(lazy, LazyShardTensor):
                continue
            if id(lazy.core) not in converted:
                core = lazy.core
                assert core.chunk is not None
                real = torch.nn.Parameter(torch.empty(0, dtype=core.dtype, device=core.chunk.device),
                                          requires_grad=lazy.requires_grad)
                setattr(real, SHARD_ATTR, core.chunk)
                setattr(real, SHAPE_ATTR, core.shape)
                tag_deepspeed(real, core.shape, self._session.world)
                real.ds_tensor = core.chunk  # type: ignore[attr-defined]  # this rank's elements (no padding yet)
                converted[id(lazy.core)] = real
            module._parameters[name] = converted[id(lazy.core)]
        del self._created[first:]
        self._settled[0] += len(converted)
        self._settled[1] += sum(int(torch.Size(getattr(p, SHAPE_ATTR)).numel()) for p in converted.values())
        return list(converted.values())


def _config_dtype(config: Any) -> torch.dtype | None:
    """The 16-bit dtype a training config enables (fp16 or bf16 set to ``true``); ``None`` for fp32, for
    ``"auto"`` (not decided yet: Hugging Face fills it in later) and without a config."""
    if config is None:
        return None
    if hasattr(config, "compute_dtype"):  # a loaded ZeroshardConfig
        return None if config.compute_dtype == torch.float32 else config.compute_dtype
    raw = read_config(config) if isinstance(config, (str, os.PathLike, Mapping)) else {}
    for key, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16)):
        block = raw.get(key)
        if isinstance(block, Mapping) and block.get("enabled") is True:
            return dtype
    return None


def _nvme_path(config: Any) -> str | None:
    """``zero_optimization.offload_param.nvme_path`` of a config (``None`` without one)."""
    if config is None:
        return None
    if hasattr(config, "zero_optimization"):  # a loaded ZeroshardConfig
        path = config.zero_optimization.offload_param.nvme_path
        return str(path) if path is not None else None
    raw = read_config(config) if isinstance(config, (str, os.PathLike, Mapping)) else {}
    zero = raw.get("zero_optimization")
    block = zero.get("offload_param") if isinstance(zero, Mapping) else None
    path = block.get("nvme_path") if isinstance(block, Mapping) else None
    return str(path) if isinstance(path, (str, os.PathLike)) and os.path.isdir(path) else None


#: The outermost ``zero.Init`` block open now, if any: torch's registration hook is process-wide,
#: so one block partitions at a time and nested blocks defer to it.
_OPEN: list[Init] = []


@contextlib.contextmanager
def outside_init() -> Iterator[None]:
    """Settle the parameters an open ``zero.Init`` block created so far, and partition nothing new
    inside the ``with``: what ``initialize`` does when called inside the block (a collective).

    The model it is given was built in the block; the engine's own parameters are not the model's.
    """
    if not _OPEN:
        yield
        return
    with _OPEN[0].paused():
        yield


#: DeepSpeed's attributes of a partitioned parameter, which Hugging Face code reads (``ds_numel`` in the
#: Trainer's parameter count, ``hasattr(p, "ds_id")`` as a ZeRO-3 test).
_DS_ATTRS = ("ds_id", "ds_numel", "ds_shape", "ds_status", "partition_numel", "ds_active_sub_modules", "ds_tensor")
#: ``ds_id`` is unique over the process, as DeepSpeed's (code keys tied weights by it): one counter for all blocks.
_ds_ids = itertools.count()


def tag_deepspeed(p: torch.nn.Parameter, shape: torch.Size, world: int) -> None:
    """Give a parameter partitioned over ``world`` ranks DeepSpeed's ``ds_id`` (once: it keeps the one
    ``zero.Init`` gave), ``ds_shape``, ``ds_numel`` and ``partition_numel()`` (the padded chunk each rank
    holds, as DeepSpeed's; Lightning's model summary at ZeRO-3 counts parameters per device with it)."""
    if not hasattr(p, "ds_id"):
        p.ds_id = next(_ds_ids)  # type: ignore[attr-defined]
    if not hasattr(p, "ds_active_sub_modules"):  # DeepSpeed's; TRL clears it before generating
        p.ds_active_sub_modules = set()  # type: ignore[attr-defined]
    if not hasattr(p, "ds_status"):  # partitioned; a ZeRO-3 unit keeps it up to date from then on
        p.ds_status = ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]
    p.ds_shape = torch.Size(shape)  # type: ignore[attr-defined]
    p.ds_numel = int(torch.Size(shape).numel())  # type: ignore[attr-defined]
    # a partial of int, not a lambda: it is called like DeepSpeed's method and still pickles with the parameter
    p.partition_numel = functools.partial(int, ShardLayout(p.ds_numel, world).shard_numel)  # type: ignore[attr-defined]
    if not isinstance(getattr(p, "ds_summary", None), DsSummary):
        p.ds_summary = DsSummary(p)  # type: ignore[attr-defined]


class DsSummary:
    """DeepSpeed's ``param.ds_summary(use_debug_name=False)``: a dict describing a ZeRO-3 parameter (its id,
    ``ds_status`` name, numel and shape as they are now and in full, ``requires_grad``, the gradient's
    shape, ``ds_persist``, ``ds_active_sub_modules``, the shape of this rank's partition ``ds_tensor``),
    with DeepSpeed's keys; scripts and DeepSpeed's own tests print it in their error messages.

    It holds its parameter weakly (no reference cycle through the parameter's ``__dict__``) and pickles
    as an unbound summary: a parameter rebuilt by ``pickle``/``torch.load`` is no longer the one it
    described.
    """

    __slots__ = ("_param",)

    def __init__(self, p: torch.nn.Parameter | None) -> None:
        self._param = None if p is None else weakref.ref(p)

    def __reduce__(self) -> tuple[type[DsSummary], tuple[None]]:
        return (DsSummary, (None,))

    def __call__(self, use_debug_name: bool = False) -> dict[str, Any]:
        p = None if self._param is None else self._param()
        if p is None:
            raise RuntimeError("ds_summary() of a parameter that was pickled or copied: its summary describes the "
                               "original parameter, which this one no longer is")
        attrs = vars(p)  # the ds_* attributes tag_deepspeed wrote
        status = attrs.get("ds_status")
        shard = attrs.get("ds_tensor")
        return {
            "id": f"name={getattr(p, 'ds_name', None)} id={attrs['ds_id']}" if use_debug_name else attrs["ds_id"],
            "status": getattr(status, "name", None),
            "numel": p.numel(),
            "ds_numel": attrs["ds_numel"],
            "shape": tuple(p.shape),
            "ds_shape": tuple(attrs["ds_shape"]),
            "requires_grad": p.requires_grad,
            "grad_shape": tuple(p.grad.shape) if p.grad is not None else None,
            "persist": getattr(p, "ds_persist", False),
            "active_sub_modules": getattr(p, "ds_active_sub_modules", set()),
            "ds_tensor.shape": shard.shape if shard is not None else None,
        }


def _gather_chunk(p: torch.nn.Parameter, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The full tensor of a parameter partitioned by ``zero.Init`` (a collective)."""
    chunk = getattr(p, SHARD_ATTR)
    shape = full_shape(p)
    layout = ShardLayout(int(torch.Size(shape).numel()), C.world_size(group))
    if chunk.device.type == "cpu" and layout.world > 1:
        return _gather_by_broadcasts(chunk, layout, group).view(shape)
    padded = torch.zeros(layout.shard_numel, dtype=chunk.dtype, device=chunk.device)
    padded[: chunk.numel()] = chunk
    out = torch.empty(layout.shard_numel * layout.world, dtype=chunk.dtype, device=chunk.device)
    C.all_gather(out, padded, group, async_op=False, what="all-gather of a zero.Init parameter")
    # A view of the receive buffer, not a copy (the padding past ``numel`` is never read).
    return out[: layout.numel].view(shape)


def _gather_by_broadcasts(chunk: torch.Tensor, layout: ShardLayout, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's chunk broadcast straight into its place in one flat tensor of ``layout.numel``.

    On gloo (CPU), ``all_gather_into_tensor`` receives into a buffer of its own and copies it into
    the output, and needs a padded input: 2.5 full-size tensors at once for one parameter (measured
    on 2 ranks), where these in-place broadcasts need the output only. It is the same bytes on the
    wire, and how transformers' ZeRO-3 ``from_pretrained`` gathers each module's parameters, so it
    sets the peak memory of loading.
    """
    out = torch.empty(layout.numel, dtype=chunk.dtype, device=chunk.device)
    me = C.rank(group)
    for r in range(layout.world):
        start, end = layout.local_range(r)
        if start == end:  # a rank holding only padding: nothing to send (the same on every rank)
            continue
        if r == me:
            out[start:end].copy_(chunk[: end - start])
        C.broadcast(out[start:end], r if group is None else dist.get_global_rank(group, r), group)
    return out


def materialize_init_params(model: torch.nn.Module, group: dist.ProcessGroup | None,
                            device: torch.device | None = None,
                            only: Callable[[torch.nn.Parameter], bool] | None = None) -> None:
    """Gather parameters built under ``zero.Init`` back into full tensors (a collective): all of
    them for stages 0–2, those ``only`` accepts for stage 3 (the ones it keeps whole: outside the
    optimizer yet requiring gradients), on ``device`` when given (a chunk may be in host memory: ``remote_device``)."""
    for p in model.parameters():
        if getattr(p, SHARD_ATTR, None) is None or (only is not None and not only(p)):
            continue
        full = _gather_chunk(p, group)
        p.data = full if device is None else full.to(device)
        delattr(p, SHARD_ATTR)
        delattr(p, SHAPE_ATTR)
        for attr in _DS_ATTRS:  # whole again: code that tests hasattr(p, "ds_id") must see a plain parameter
            if hasattr(p, attr):
                delattr(p, attr)


class InitPartitioned:
    """What ``GatheredParameters`` uses for parameters partitioned by ``zero.Init`` before
    ``initialize`` owns them (how transformers loads pretrained weights into a ZeRO-3 model):
    gather them whole for the block, and on exit write the (broadcast) values back into each
    rank's chunk, so that ``initialize`` partitions what was written."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group

    def gather_context(self, params: list[torch.nn.Parameter]) -> tuple[Any, Any]:
        """``(enter, exit)``: make ``params`` whole, then empty placeholders again."""

        def enter() -> None:
            for p in params:
                p.data = _gather_chunk(p, self.group)
                p.ds_status = ZeroParamStatus.AVAILABLE  # type: ignore[attr-defined]

        def exit_() -> None:
            for p in params:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                p.ds_status = ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]
            # Return the freed full tensors' heap pages, as zero.Init does: transformers gathers
            # module by module, and the heap would otherwise keep about the whole model after
            # loading (measured: about 110 MiB of a 222 MiB model per rank, see
            # benchmarks/results/hf_from_pretrained_memory.md).
            if any(p.device.type == "cpu" for p in params):
                host_memory.trim()

        return enter, exit_

    def write_back(self, p: torch.nn.Parameter) -> None:
        """Copy this rank's part of the whole (modified) ``p`` into its chunk."""
        chunk = getattr(p, SHARD_ATTR)
        layout = ShardLayout(p.numel(), C.world_size(self.group))
        s, e = layout.local_range(C.rank(self.group))
        chunk.copy_(p.data.reshape(-1)[s:e])


__all__ = ["Init", "InitPartitioned", "ShardCore", "materialize_init_params"]
