"""ZeRO stages 0–2 as one composition: master shard + gradient sync + any torch optimizer.

Design note
-----------
- stage 0: every rank owns whole parameters (shard layout of world 1); gradients are
  all-reduced; the optimizer steps every element on every rank.
- stage 1: the fp32 master weights and the optimizer state are sharded; full gradients are
  accumulated locally and reduce-scattered once per accumulation window.
- stage 2: stage 1, with gradients reduce-scattered every micro-step from backward hooks, so only
  this rank's gradient shard persists.
After the optimizer step, stages 1–2 all-gather the updated shards into the module's (compute
dtype) parameters in ``allgather_bucket_size`` buckets; stage 0 copies its masters in place.

The step: unscale (fp16), global norm (all-reduced over shards; a non-finite norm means overflow
on *some* rank, so every rank skips together), clip, optimizer step, publish parameters.
Memory residency per rank (Ψ parameters, N ranks, 16-bit compute, Adam): module params 2Ψ;
gradients ``a·Ψ`` (stages 0–1) or ``a·Ψ/N`` (stage 2) with ``a`` the accumulation dtype's bytes;
master 4Ψ/N and Adam state 8Ψ/N (stages 1–2), or 4Ψ and 8Ψ at stage 0. In fp32 the masters are
views into the module's parameters and cost nothing extra.

Offload is a policy, not a branch: :class:`~zeroshard.core.offload.OffloadPolicy` places the masters
(device or host memory, or swap files), the gradient shard goes where the masters are, and the
step, checkpoints and memory accounting reach masters and optimizer state only through the state
store (:mod:`zeroshard.core.offload.state_store`), which steps the torch optimizer sub-group by
sub-group wherever they live.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from zeroshard.core import host_memory
from zeroshard.core.comm import collectives as C
from zeroshard.core.grad_sync import GradSync
from zeroshard.core.master import MasterShard
from zeroshard.core.offload import OffloadPolicy
from zeroshard.core.offload.policy import Residency
from zeroshard.core.offload.state_store import StateStore, SubGroup
from zeroshard.core.partition import Bucket
from zeroshard.core.plan import StagePlan
from zeroshard.core.precision import LossScaler, PrecisionPolicy
from zeroshard.errors import ZeroshardError

if TYPE_CHECKING:
    from zeroshard.core.zero3.coordinator import ParamCoordinator
    from zeroshard.core.zero3.frozen import FrozenShard

logger = logging.getLogger("zeroshard")


@dataclass(frozen=True)
class StageSpec:
    """What the engine's config asks of the stage (from ``zero_optimization`` and the top level)."""

    stage: int = 0
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = True
    gradient_clipping: float = 0.0
    #: ZeRO-3 only: parameters kept gathered at most (beyond it, least recently used units go).
    max_live_parameters: int = 1_000_000_000
    #: ZeRO-3 only: elements of upcoming units gathered ahead of use (0 turns prefetching off).
    prefetch_bucket_size: int = 50_000_000
    #: ZeRO-3 only: units with at most this many elements stay gathered all the time.
    param_persistence_threshold: int = 100_000
    #: a step whose gradient norm is NaN or Inf is skipped (False: applied, bf16's
    #: ``check_grad_overflow: false`` as in DeepSpeed; fp16's loss scaling always checks)
    skip_non_finite: bool = True
    #: ZeRO++ qwZ (stage 3): parameter all-gathers carry blockwise int8 and scales
    quantized_weights: bool = False
    #: ZeRO++ qgZ (stages 2-3): gradients reduced by quantized all-to-alls, node by node
    quantized_gradients: bool = False
    #: ZeRO++ hpZ (stage 3): ranks of the group a gathered unit keeps a secondary shard over (1: off)
    hpz_partition_size: int = 1


@dataclass(frozen=True)
class StageParts:
    """The collaborators a stage is composed of, built together by :func:`zeroshard.core.build.build_stage`."""

    #: the flat layout of the trained parameters (one bucket per ZeRO-3 unit)
    buckets: list[Bucket]
    #: the fp32 master shard
    master: MasterShard
    #: where masters and optimizer state live, and the one way to read, write and step them
    store: StateStore
    #: the gradient reduction of the stage
    sync: GradSync
    #: which copies exist and where (:mod:`zeroshard.core.plan`)
    plan: StagePlan


def in_memory_bytes(places: dict[str, int]) -> int:
    """The bytes of a ``{place: bytes}`` placement held in memory (device or host), not in swap files."""
    return sum(v for k, v in places.items() if k != "file")


class ZeroOptimizer:
    """The optimizer ``initialize`` returns for stages 0–2.

    It owns the fp32 master shard, the gradient synchronisation and a torch optimizer that steps
    on the shard. ``param_groups`` is the torch optimizer's, so LR schedulers and user code that
    reads or writes ``optimizer.param_groups[i]["lr"]`` work unchanged.
    """

    #: ZeRO-3's unit coordinator (gather, prefetch, release); ``None`` at stages 0-2
    coordinator: ParamCoordinator | None = None
    #: ZeRO-3's shard of the frozen parameters; ``None`` at stages 0-2
    frozen: FrozenShard | None = None

    def __init__(self, param_groups: list[dict[str, Any]], spec: StageSpec, policy: PrecisionPolicy,
                 scaler: LossScaler, group: dist.ProcessGroup | None, device: torch.device,
                 offload: OffloadPolicy, parts: StageParts) -> None:
        self.spec = spec
        self.policy = policy
        self.offload = offload
        self.scaler = scaler
        self.group = group
        self.device = device
        self.rank = C.rank(group)
        self.world = C.world_size(group)
        self.plan = parts.plan
        self.buckets = parts.buckets
        self.master = parts.master
        #: where master weights and optimizer state live, and the one way to read or write them
        self.store = parts.store
        self.sync = parts.sync
        #: stages 0–2: the tensor each trained parameter's ``.data`` is bound to (:meth:`note_parameter_data`)
        self._bound: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._group_options = [{k: v for k, v in g.items() if k != "params"} for g in param_groups]
        self._group_params = [list(g["params"]) for g in param_groups]
        self.optimizer: torch.optim.Optimizer | None = None
        self.global_grad_norm: float | None = None
        self.overflow = False
        #: after a skipped step: the first parameter whose gradient was NaN or Inf (``None``: none
        #: was, the norm itself overflowed)
        self.nonfinite_param: torch.nn.Parameter | None = None

    @property
    def sharded(self) -> bool:
        """Whether master weights and optimizer state are split across ranks (the plan's)."""
        return self.plan.sharded

    @property
    def replica(self) -> int:
        """Hybrid sharding: which copy of the sharded state this rank's group holds (0 without:
        the only one). Checkpoints are written by replica 0."""
        return C.rank(self.sync.replicate) if self.sync.replicate is not None else 0

    def grad_shard(self) -> list[torch.Tensor]:
        """This rank's reduced gradient shard, one flat tensor per bucket of ``self.buckets``."""
        return self.sync.shard_grads()

    # -- optimizer wiring ---------------------------------------------------------------------
    def master_param_groups(self) -> list[dict[str, Any]]:
        """Param groups over the fp32 master views, with the caller's per-group options."""
        return [
            {"params": [self.master.views[p] for p in ps], **opts}
            for ps, opts in zip(self._group_params, self._group_options)
        ]

    def bind(self, make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]) -> None:
        """Create the torch optimizer over the master views."""
        self.optimizer = make_optimizer(self.master_param_groups())
        self.store.bind(self.optimizer)

    def adopt(self, client: torch.optim.Optimizer) -> None:
        """Re-point a client optimizer, built over the module's parameters, at the master views."""
        if client.state:
            raise ValueError("the client optimizer already has state; pass it to initialize() before stepping")
        for g in client.param_groups:
            # A frozen parameter listed in a group (a group built before freezing) is not trained
            # and has no master: it leaves the group, as DeepSpeed keeps only those requiring grad.
            g["params"] = [self.master.views[p] for p in g["params"] if p.requires_grad]
        self.optimizer = client
        self.store.bind(client)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The torch optimizer's param groups (over the master shard)."""
        return self._inner.param_groups

    @property
    def state(self) -> Any:
        """The torch optimizer's per-parameter state (of this rank's shard)."""
        return self._inner.state

    @property
    def _inner(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError("ZeroOptimizer used before an optimizer was bound")
        return self.optimizer

    # -- training -------------------------------------------------------------------------------
    def start_backward(self, boundary: bool) -> None:
        """Before ``loss.backward()``: at the window's last micro-step, swapped optimizer state
        starts coming in from its files while backward runs (unless parameters are swapped too)."""
        self.sync.start_backward(boundary)
        # Not when backward reads parameters from the disk too: the early reads then compete with
        # them (the 2.4B ZeRO-Infinity run got 12% slower), and the step only moves later.
        if boundary and not self._backward_reads_parameter_files():
            self.store.prefetch()

    def _backward_reads_parameter_files(self) -> bool:
        """Whether the coming backward reads parameters from swap files (ZeRO-3 overrides it)."""
        return self.offload.params is Residency.FILE

    def finish_backward(self) -> None:
        """After ``loss.backward()``: complete this micro-step's gradient communication (and, with
        ``ZEROSHARD_MALLOC_TRIM=1`` on CPU, give the heap the backward freed back to the system:
        :mod:`~zeroshard.core.host_memory`)."""
        self.sync.finish_backward()
        host_memory.trim(self.device, site="step")

    _direct_step_warned = False

    def step(self, *, by_engine: bool = False) -> bool:
        """Unscale, check overflow, clip and step. Returns whether the update was applied.

        ``engine.step()`` calls it with ``by_engine``; a call without it is the script's own, which
        skips the engine's counters and scheduler (a warning says so, once).
        """
        if not by_engine and not ZeroOptimizer._direct_step_warned:
            ZeroOptimizer._direct_step_warned = True
            # DeepSpeed is silent here too; it trains wrongly with gradient accumulation or a scheduler
            logger.warning("optimizer.step() was called directly: the engine's step counters, gradient "
                           "accumulation window and learning-rate scheduler are skipped, so training "
                           "differs from what the config says. Call engine.step() after each "
                           "engine.backward(loss) instead (it steps the optimizer at each accumulation "
                           "boundary)")
        self.rebind_parameters(keep_values=True)  # the forward and backward just ran on the replaced values
        dropped = self.sync.take_exposed()  # stage 0's .grad, as the script left it
        g32 = [g if g.dtype == torch.float32 else g.float() for g in self.grad_shard()]
        if self.sync.spills:  # one bucket at a time, its pages let go after: the same operations
            for g in g32:
                if self.scaler.scale != 1.0:
                    g.mul_(1.0 / self.scaler.scale)
                self.sync.release_pages(g)
        elif self.scaler.scale != 1.0:
            torch._foreach_mul_(g32, 1.0 / self.scaler.scale)
        norm = self._global_norm(g32)
        self.overflow = not math.isfinite(norm) and self.spec.skip_non_finite
        self.nonfinite_param = self._first_nonfinite(g32) if self.overflow else None
        if self.overflow:
            self.sync.zero()
        self.scaler.update(self.overflow)  # fp16 at the minimum scale: raises
        # A skipped step reports an infinite norm, as DeepSpeed's optimizers do (NaN included): logs
        # (the HF Trainer's grad_norm) then show the skip instead of repeating the last applied norm.
        self.global_grad_norm = math.inf if self.overflow else norm
        if self.overflow:
            return False
        clip = self.spec.gradient_clipping
        coef = clip / (norm + 1e-6) if clip > 0 else 1.0
        if coef < 1.0 and not self.sync.spills:
            torch._foreach_mul_(g32, coef)
        unused = {self.master.views[p] for p in (*self.sync.unused_params(), *dropped)}
        stepped = self._begin_publish()
        if self.sync.spills:
            # Clipped sub-group by sub-group as it is stepped, and its pages discarded after: a pass
            # clipping the whole file-backed shard first dirtied every page again, which the page
            # cache wrote back to the disk (about the shard's size per step) before the step read it.
            self._step_store(g32, unused, self._discarding(g32, stepped),
                             self._clipping(g32, coef) if coef < 1.0 else None)
        else:
            self._step_store(g32, unused, stepped, None)
        self.sync.zero()
        # Swap-file writes the step left in flight overlap the rest of the publish, and the next forward.
        if stepped is None:
            self.publish()
        else:
            with torch.no_grad():
                self.master.end_all_gather()
        host_memory.trim(self.device, site="step")
        return True

    def _first_nonfinite(self, g32: list[torch.Tensor]) -> torch.nn.Parameter | None:
        """The first parameter (in layout order, over all ranks) with a NaN or Inf gradient. Only
        after an overflow: one small all-reduce, which every rank makes (they agree on overflow)."""
        first = len(self.master.slices)
        for i, (_master, bucket, off, n) in enumerate(self.master.slices):
            if not torch.isfinite(g32[bucket][off : off + n]).all():
                first = i
                break
        index = torch.tensor([first], dtype=torch.int64, device=C.control_device(self.group))
        if self.sharded:
            C.all_reduce(index, self.group, async_op=False, op=dist.ReduceOp.MIN)
        if int(index) == len(self.master.slices):
            return None
        master = self.master.slices[int(index)][0]
        return next(p for p, m in self.master.views.items() if m is master)

    def current_grad_norm(self) -> float:
        """The global norm of the gradients accumulated so far in this window, loss scale divided out
        (collective when sharded)."""
        g32 = [g.float() for g in self.grad_shard()]
        return self._global_norm(g32) / float(self.scaler.scale)

    def _step_store(self, g32: list[torch.Tensor], skip: set[torch.nn.Parameter],
                    stepped: Callable[[SubGroup], None] | None, prepare: Callable[[SubGroup], None] | None) -> None:
        """Step every sub-group of the state store (ZeRO-3 with swapped state overrides it: the
        next forward steps them)."""
        self.store.step(g32, skip=skip, stepped=stepped, prepare=prepare)

    @staticmethod
    def _clipping(g32: list[torch.Tensor], coef: float) -> Callable[[SubGroup], None]:
        """Multiply one sub-group's gradients by the clipping coefficient (the same operation as
        the whole shard's in-place multiply, so the same bits), just before it is stepped."""
        def clip(sg: SubGroup) -> None:
            for _master, b, off, n in sg.slices:
                g32[b][off : off + n].mul_(coef)

        return clip

    def _discarding(self, g32: list[torch.Tensor],
                    stepped: Callable[[SubGroup], None] | None) -> Callable[[SubGroup], None]:
        """``stepped`` that first discards the sub-group's spilled gradients: stepped, they are not
        read again, and neither the process nor the disk need keep them."""
        def after(sg: SubGroup) -> None:
            for _master, b, off, n in sg.slices:
                self.sync.discard_pages(g32[b][off : off + n])
            if stepped is not None:
                stepped(sg)

        return after

    def _global_norm(self, g32: list[torch.Tensor]) -> float:
        if self.sync.spills:
            # As get_total_norm computes it (a norm per tensor, then their norm), a tensor at a time
            norms: list[torch.Tensor] = []
            for g in g32:
                norms.extend(torch._foreach_norm([g], 2.0))
                self.sync.release_pages(g)
            local = torch.linalg.vector_norm(torch.stack(norms), 2.0) if norms else torch.zeros(())
        elif g32 and g32[0].device.type == "cpu" and self.device.type != "cpu":
            # Optimizer offload on an accelerator: the shard is in host memory. BLAS dot products use
            # every core; torch's CPU norm kernel took 1.15 s for 2.5B elements on a 16-core host
            # (40% of the step), the dots take a fraction of it.
            local = torch.stack([torch.dot(g, g) for g in g32]).sum().sqrt()
        else:
            local = torch.nn.utils.get_total_norm(g32, norm_type=2.0) if g32 else torch.zeros(())
        sq = local.to(torch.float32).square().reshape(1).to(self.device)  # NCCL reduces device tensors
        if self.sharded:
            C.all_reduce(sq, self.group, async_op=False)
        return float(sq.sqrt().item())

    def _begin_publish(self) -> Callable[[SubGroup], None] | None:
        """Sharded stages 1-2: start the parameters' all-gather, to be advanced as each of the
        store's sub-groups is stepped, so that its collectives overlap the next sub-group's step and
        swap-file reads instead of following the whole step. ``None``: :meth:`publish` after it."""
        if not self.sharded:
            return None
        self.master.begin_all_gather(self.group, self.spec.allgather_bucket_size, self.policy.param_dtype,
                                     cuts=[sg.end for sg in self.store.subgroups])

        def stepped(sg: SubGroup) -> None:
            with torch.no_grad():
                self.master.all_gather_through(sg.end)

        return stepped

    def note_parameter_data(self) -> None:
        """Stages 0–2: remember the tensor each trained parameter's ``.data`` is now (after the module's
        cast to the compute dtype). The masters alias it (fp32) or each update is published into it."""
        if not self.plan.shards_parameters:
            self._bound = {p: p.data for p in self.master.views}

    def _rebind(self, p: torch.nn.Parameter, keep_values: bool) -> None:
        """User code that replaced ``p.data`` (``p.data = new`` instead of copying into it: custom
        initialisation, ``GatheredParameters`` edits) left the masters on the old tensor, so ``p``
        stopped training. Bind ``p`` back to it, with the new values first when ``keep_values``
        (plain PyTorch trains from them) or not (a checkpoint was loaded after the replacement)."""
        bound = self._bound.get(p)
        if bound is None or (p.data_ptr() == bound.data_ptr() and p.shape == bound.shape):
            return
        new = p.data
        if (new.shape, new.dtype, new.device) != (bound.shape, bound.dtype, bound.device):
            raise ZeroshardError(
                f"a trained parameter of shape {tuple(bound.shape)} ({bound.dtype}, {bound.device}) was given a new "
                f".data of shape {tuple(new.shape)} ({new.dtype}, {new.device}) after initialize; its master weights "
                "and optimizer state keep the old layout. Copy values into it instead (with torch.no_grad(): "
                "p.copy_(new)), or change the model before initialize")
        with torch.no_grad():
            if keep_values:
                bound.copy_(new)
            p.data = bound
            if keep_values and not self.master.aliased:
                s, e = self.master.ranges[p]
                self.store.write_master(self.master.views[p], bound.reshape(-1)[s:e])

    def rebind_parameters(self, keep_values: bool = True) -> None:
        """:meth:`_rebind` every trained parameter whose ``.data`` user code replaced (stages 0–2)."""
        for p in self._bound:
            self._rebind(p, keep_values)

    def publish(self) -> None:
        """Make the module's parameters reflect the (updated or loaded) master weights."""
        self.rebind_parameters(keep_values=False)
        self.store.refresh()
        with torch.no_grad():
            if self.sharded:
                self.master.all_gather_to_params(self.group, self.spec.allgather_bucket_size,
                                                 self.policy.param_dtype)
            else:
                self.master.copy_to_params()

    def write_back(self, p: torch.nn.Parameter) -> None:
        """Make the module's (full) value of ``p`` the new master value of this rank's chunk."""
        self._rebind(p, keep_values=True)
        s, e = self.master.ranges[p]
        self.store.write_master(self.master.views[p], p.detach().reshape(-1)[s:e])

    def gather_context(self, params: list[torch.nn.Parameter]) -> tuple[Callable[[], None], Callable[[], None]]:
        """``(enter, exit)`` callables making ``params`` readable; stages 0–2 hold them whole already."""
        return (lambda: None), (lambda: None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated gradients (DeepSpeed compatibility; the engine zeroes after each step)."""
        self.sync.zero()

    def close(self) -> None:
        """Release what the state store holds outside memory (swap files, I/O threads)."""
        self.store.close()

    def detach(self) -> None:
        """Remove the gradient hooks from the parameters and :meth:`close`: an engine being
        destroyed, or one ``initialize`` failed to finish. Training afterwards is not possible."""
        self.sync.remove_hooks()
        self.close()

    def memory_placement(self) -> dict[str, dict[str, int]]:
        """Bytes of each kind of state by where they live (``device``, ``host``, ``pinned_host``,
        ``file``): ``{"master_weights": {"host": n}, ...}``."""
        out = self.store.bytes_held()
        acc_device = self.sync.acc_device
        pinned = acc_device.type == "cpu" and self.device.type != "cpu" and torch.cuda.is_available()
        out["gradients"] = {"device" if acc_device.type != "cpu" else ("pinned_host" if pinned else "host"):
                            self.sync.bytes_held()}
        spilled = self.sync.spilled_bytes()
        if spilled:  # NVMe: a file-backed buffer whose pages are in the process only while used
            out["gradients"] = {"file": spilled}
        if self.master.compute_copy:  # stages 1-2 with the masters in files
            src = self.master.pack_source
            place = "device" if src.device.type != "cpu" else "host"
            out["parameter_shard"] = {place: src.numel() * src.element_size()}
        return out

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds in memory (device and host) for gradients, master weights and
        optimizer state; :meth:`memory_placement` says where, swap files included."""
        held = self.store.bytes_held()
        return {
            "gradients": self.sync.bytes_held(),
            "master_weights": in_memory_bytes(held["master_weights"]),
            "optimizer_states": in_memory_bytes(held["optimizer_states"]),
            "comm_workspace": self.sync.workspace_bytes() + self.master.workspace_bytes(),
            **({"parameter_shard": self.master.pack_source.numel() * self.master.pack_source.element_size()}
               if self.master.compute_copy else {}),
        }
