"""Quantized collectives for ZeRO++ (arXiv 2306.10209), in plain torch operations.

- **qwZ** (DeepSpeed's ``zero_quantized_weights``): the stage-3 parameter all-gather moves int8
  values and one scale per block instead of bf16/fp32 (:func:`quantized_all_gather`);
- **qgZ** (DeepSpeed's ``zero_quantized_gradients``): the gradient reduce-scatter becomes a
  hierarchical all-to-all of 4-bit values, first inside the node, then across nodes among the ranks
  with the same local index (:func:`quantized_reduce_scatter`).

No compiled extension: the same code runs on CPU tensors over gloo and on CUDA tensors over NCCL.

What DeepSpeed does (``deepspeedai/DeepSpeed`` at ``edaa722``):

- ``deepspeed/runtime/zero/partition_parameters.py``, ``CUDAQuantizer``: qwZ quantizes each rank's
  partition to **8 bits, symmetric** (``quantizer_cuda_module.Symmetric``: one scale per group, no
  zero point), groups of at most ``target_group_size = 8000`` elements ("the optimal size is 4k")
  chosen so they divide the partition (:func:`deepspeed_qwz_block_size`), and all-gathers the
  int8 partitions and the scales in two all-gathers; the receivers dequantize the whole buffer.
- ``csrc/quantization/pt_binding.cpp`` and ``csrc/includes/quantization_utils.h``: the scales
  are **fp32** (``at::kFloat``, one per group, two with a zero point for the asymmetric kind); the
  symmetric kind stores ``absmax / 2**(bits-1)`` and rounds to nearest (``__float2int_rn``),
  clamping to ``[-2**(bits-1), 2**(bits-1) - 1]``; 4-bit values are packed two per byte.
- ``deepspeed/runtime/comm/coalesced_collectives.py``, ``all_to_all_quant_reduce``: qgZ uses
  **4 bits in both steps**, symmetric, ``max(rows, cols, world)`` groups for a 2-D gradient (the
  inter-node step has ``1 / local_world`` as many, so the same group size:
  :func:`deepspeed_qgz_block_size`); step 1 is an ``all_to_all_single`` inside the node (group
  ``local_{node}``), the receiver dequantizes, sums the ``local_world`` pieces and re-quantizes
  (``quantized_reduction``, summing in fp16 there), step 2 an ``all_to_all_single`` across nodes
  among the ranks with the same local index (group ``global_{local index}``), then a dequantize
  and a sum over the nodes. 1-D tensors and tensors whose size is not a multiple of
  ``2 * world`` fall back to the plain reduce-scatter.

Our choices, and where they differ:

- symmetric like DeepSpeed, fp32 scales like DeepSpeed, but the scale is ``absmax / (2**(bits-1) - 1)``
  (127 for int8, 7 for int4) so that ``+absmax`` is representable: every value's error is at most
  half a step (``scale / 2``). DeepSpeed's ``absmax / 2**(bits-1)`` clamps ``+absmax`` to
  ``127/128`` (``7/8`` at 4 bits), a full step off. The code ``-2**(bits-1)`` is unused;
- any size: the last block may be short (DeepSpeed asserts divisibility or falls back); nothing
  is padded on the wire, so a shard smaller than a block costs its own codes and one scale;
- sums in fp32 (DeepSpeed's ``quantized_reduction`` kernel adds in fp16);
- in :func:`quantized_reduce_scatter` blocks never straddle two ranks' shards, so the same blocks
  serve both steps and each shard is quantized on its own;
- a block of all zeros has scale 0 and dequantizes to zeros (no division by zero); a block with an
  inf or NaN dequantizes to NaN in every element, so an overflow check after the collective still
  sees it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zeroshard.core.comm.collectives import (
    ProcessGroup,
    _all_gather_flat,
    _begin,
    _logged,
    _nbytes,
    world_size,
)

#: DeepSpeed's ``CUDAQuantizer.target_group_size`` (qwZ): groups hold at most this many elements
QWZ_TARGET_BLOCK = 8000
#: bits DeepSpeed's qwZ quantizes weights to
QWZ_BITS = 8
#: bits DeepSpeed's qgZ quantizes gradients to, in both the intra- and the inter-node step
QGZ_BITS = 4
#: the widths implemented here
BITS = (4, 8)
#: scale, zero point, and the work of every block are fp32
_COMPUTE = torch.float32


def deepspeed_qwz_block_size(numel: int) -> int:
    """The group size DeepSpeed's ``CUDAQuantizer.quantize`` picks for a partition of ``numel``
    elements: the fewest groups, from ``ceil(numel / 8000)`` up, whose size divides ``numel`` and is
    a multiple of 8. DeepSpeed asserts when ``numel`` is not a multiple of 8; we pad instead, so
    there this returns :data:`QWZ_TARGET_BLOCK`."""
    if numel <= 0 or numel % 8:
        return QWZ_TARGET_BLOCK
    groups = math.ceil(numel / QWZ_TARGET_BLOCK)
    while numel % (8 * groups):
        groups += 1
    return numel // groups


def deepspeed_qgz_block_size(shape: Sequence[int], world: int) -> int:
    """The group size of DeepSpeed's qgZ for a 2-D gradient of ``shape`` on ``world`` ranks:
    ``numel / max(rows, cols, world)`` (``all_to_all_quant_reduce``), i.e. usually the shorter side."""
    if len(shape) != 2:
        raise ValueError(f"DeepSpeed's qgZ groups 2-D gradients only (others fall back), got shape {tuple(shape)}")
    rows, cols = int(shape[0]), int(shape[1])
    return max(1, rows * cols // max(rows, cols, world))


@dataclass(frozen=True, eq=False)
class Quantized:
    """A tensor quantized block by block, symmetric, with one fp32 scale per block.

    Attributes:
        payload: the codes, one per element: int8 at 8 bits; at 4 bits two per uint8 byte
            (two's-complement nibbles, element ``2i`` in the low nibble of byte ``i``, a zero
            nibble after an odd count), so the bytes really halve.
        scales: fp32, one per block: the step between two codes (``absmax / (2**(bits-1) - 1)``);
            0 for a block of zeros.
        numel: elements of the original tensor; the last of its ``ceil(numel / block_size)``
            blocks may be short.
        dtype: the original tensor's dtype.
        block_size: elements per block.
        bits: 8 or 4.
    """

    payload: torch.Tensor
    scales: torch.Tensor
    numel: int
    dtype: torch.dtype
    block_size: int
    bits: int

    @property
    def nbytes(self) -> int:
        """Bytes a collective moves for it: payload plus scales."""
        return _nbytes(self.payload) + _nbytes(self.scales)


def _check(block_size: int, bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")


def _qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def _encode(rows: torch.Tensor, block_size: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``rows`` ``[R, m]`` on its own, in ``B = ceil(m / block_size)`` blocks
    (the last one short): codes ``[R, ceil(m * bits / 8)]`` and fp32 scales ``[R, B]``. The short
    block is padded with zeros to find its scale only; no padding is sent."""
    r, m = rows.shape
    blocks = -(-m // block_size)
    x = rows.to(_COMPUTE)
    owned = rows.dtype != _COMPUTE  # x is a copy we may overwrite
    if blocks * block_size != m:
        x, owned = torch.nn.functional.pad(x, (0, blocks * block_size - m)), True
    x = x.reshape(r * blocks, block_size)
    qmax = _qmax(bits)
    scales = x.abs().amax(dim=1) / qmax if x.numel() else x.new_empty(r * blocks)
    # A block of zeros keeps scale 0 and divides by 1. An inf in the block makes its scale inf
    # and every code 0 (NaN for the inf itself, zeroed below), so it dequantizes to 0 * inf = NaN;
    # a NaN makes the scale NaN (not > 0: divides by 1) and every value dequantizes to NaN.
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = x.div_(divisor.unsqueeze(1)) if owned else x / divisor.unsqueeze(1)
    codes = q.round_().clamp_(-qmax, qmax).nan_to_num_(0.0).to(torch.int8).view(r, -1)[:, :m]  # half to even
    if bits == 4:  # two's-complement nibbles, shifted as unsigned bytes (no signed overflow)
        if m % 2:
            codes = torch.cat((codes, codes.new_zeros(r, 1)), dim=1)
        pairs = codes.view(torch.uint8).reshape(r, -1, 2)
        return (pairs[..., 0] & 0x0F).bitwise_or_((pairs[..., 1] & 0x0F) << 4), scales.view(r, blocks)
    return codes.contiguous(), scales.view(r, blocks)


def _decode(payload: torch.Tensor, scales: torch.Tensor, numel: int, block_size: int, bits: int) -> torch.Tensor:
    """The fp32 values ``[R, numel]`` of ``payload`` ``[R, bytes]`` and ``scales`` ``[R, blocks]``
    (rows as :func:`_encode` made them)."""
    r = payload.shape[0]
    blocks = -(-numel // block_size)
    if bits == 4:
        nibbles = torch.stack((payload & 0x0F, payload >> 4), dim=2).view(torch.int8).view(r, -1)  # 0..15
        codes = nibbles[:, :numel].bitwise_xor_(8).sub_(8)  # sign-extended: 8..15 -> -8..-1
    else:
        codes = payload
    if blocks * block_size != numel:  # the short last block: pad its codes to multiply by whole blocks
        codes = torch.nn.functional.pad(codes, (0, blocks * block_size - numel))
    values = codes.reshape(r * blocks, block_size).to(_COMPUTE).mul_(scales.reshape(-1, 1))
    return values.view(r, -1)[:, :numel]


def quantize_blockwise(x: torch.Tensor, block_size: int, bits: int = 8) -> Quantized:
    """Quantize ``x`` (any float dtype and shape, read flat) symmetrically in blocks of
    ``block_size`` elements with round-to-nearest: each value's error is at most half its block's
    scale. ``bits`` is 8 (int8, qwZ's) or 4 (packed two per byte, qgZ's)."""
    _check(block_size, bits)
    if not x.is_floating_point():
        raise TypeError(f"quantize_blockwise takes a floating-point tensor, got {x.dtype}")
    payload, scales = _encode(x.reshape(1, -1), block_size, bits)
    return Quantized(payload.view(-1), scales.view(-1), x.numel(), x.dtype, block_size, bits)


def dequantize(q: Quantized, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of ``q``: written into ``out`` (``q.numel`` elements, any shape and float dtype)
    and returned, or a new flat tensor of ``dtype``."""
    flat = _decode(q.payload.view(1, -1), q.scales, q.numel, q.block_size, q.bits).view(-1)
    if out is None:
        return flat.to(dtype)
    if out.numel() != q.numel:
        raise ValueError(f"out has {out.numel()} elements, the quantized tensor {q.numel}")
    out.copy_(flat.view(out.shape))
    return out


class _Works:
    """Several collectives waited on as one (what :func:`_logged` hands the logger)."""

    def __init__(self, works: Sequence[dist.Work | None]) -> None:
        self.works = list(works)

    def wait(self) -> bool:
        for w in self.works:
            if w is not None:
                w.wait()
        self.works = []
        return True


class QuantizedGather:
    """A quantized all-gather in flight: :meth:`wait` waits for the payloads and scales and
    dequantizes them into the output, which it returns."""

    def __init__(self, works: _Works, sent: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor,
                 payload: torch.Tensor, scales: torch.Tensor, shard_numel: int, block_size: int, bits: int) -> None:
        # ``sent``: this rank's quantized shard, kept alive while the gathers read it
        self.works, self.sent, self.out, self.payload, self.scales = works, sent, out, payload, scales
        self.shard_numel, self.block_size, self.bits = shard_numel, block_size, bits
        self.done = False

    def wait(self) -> torch.Tensor:
        """Block until the gather is done and ``out`` holds every rank's dequantized shard."""
        if not self.done:
            self.works.wait()
            values = _decode(self.payload, self.scales, self.shard_numel, self.block_size, self.bits)
            self.out.view(values.shape).copy_(values)
            self.done = True
            del self.sent, self.payload, self.scales
        return self.out


def quantized_all_gather(out: torch.Tensor, shard: torch.Tensor, group: ProcessGroup | None, block_size: int,
                         async_op: bool = True, bits: int = QWZ_BITS) -> QuantizedGather | None:
    """qwZ: every rank's ``shard`` (equal sizes), quantized, gathered and dequantized into ``out``
    (``world * shard.numel()`` elements, contiguous, any float dtype) in rank order, as
    :func:`~zeroshard.core.comm.collectives.all_gather` lays it out.

    Each rank quantizes its shard (:func:`quantize_blockwise`, 8 bits by default as DeepSpeed's
    ``CUDAQuantizer``), then payloads and scales go in two flat all-gathers, logged together as one
    ``all_gather_into_tensor`` of their real bytes (gathered payload plus gathered scales). Each
    element of ``out`` is off by at most half its block's scale (plus rounding to ``out``'s dtype).
    With ``async_op`` it returns a handle whose ``wait()`` finishes the dequantize; ``out`` is not
    ready before. On one rank it copies ``shard`` exactly and returns ``None``.
    Dequantizing takes an fp32 temporary of ``out``'s size.
    """
    _begin("quantized all-gather")
    _check(block_size, bits)
    n = world_size(group)
    if out.numel() != n * shard.numel():
        raise ValueError(f"out has {out.numel()} elements; {n} ranks' shards of {shard.numel()} "
                         f"need {n * shard.numel()}")
    if n == 1:
        out.view(-1).copy_(shard.reshape(-1))
        return None
    payload, scales = _encode(shard.reshape(1, -1), block_size, bits)
    all_payload = payload.new_empty(n, payload.shape[1])
    all_scales = scales.new_empty(n, scales.shape[1])
    nbytes = _nbytes(all_payload) + _nbytes(all_scales)

    def launch() -> _Works:
        return _Works([_all_gather_flat(all_payload.view(-1), payload.view(-1), group=group, async_op=async_op),
                       _all_gather_flat(all_scales.view(-1), scales.view(-1), group=group, async_op=async_op)])

    works = _logged("all_gather_into_tensor", nbytes, out.device, launch, group)
    handle = QuantizedGather(works, (payload, scales), out, all_payload, all_scales, shard.numel(), block_size, bits)
    if async_op:
        return handle
    handle.wait()
    return None


def _exchange(rows: torch.Tensor, group: ProcessGroup, block_size: int, bits: int) -> torch.Tensor:
    """One quantized all-to-all of ``rows`` ``[k, group size, s]`` (row ``[:, j]`` goes to group rank
    ``j``): quantize each ``s``-chunk on its own, swap, dequantize and sum what the ``group size``
    peers sent, in fp32. Returns ``[k, s]``."""
    k, n, s = rows.shape
    payload, scales = _encode(rows.reshape(k * n, s), block_size, bits)
    send_p = payload.view(k, n, -1).transpose(0, 1).contiguous()  # by destination
    send_s = scales.view(k, n, -1).transpose(0, 1).contiguous()
    recv_p, recv_s = torch.empty_like(send_p), torch.empty_like(send_s)

    def launch() -> _Works:
        return _Works([dist.all_to_all_single(recv_p, send_p, group=group, async_op=True),
                       dist.all_to_all_single(recv_s, send_s, group=group, async_op=True)])

    _logged("all_to_all_single", _nbytes(send_p) + _nbytes(send_s), rows.device, launch, group).wait()
    values = _decode(recv_p.view(n * k, -1), recv_s.view(n * k, -1), s, block_size, bits)
    return values.reshape(n, k, s).sum(dim=0)  # [source, k, s] summed over the sources


def _level(group: ProcessGroup | None) -> int:
    return 1 if group is None else world_size(group)


def quantized_reduce_scatter(out_shard: torch.Tensor, inp: torch.Tensor, intra_group: ProcessGroup | None,
                             inter_group: ProcessGroup | None, block_size: int, bits: int = QGZ_BITS,
                             average: bool = False, intra_bits: int | None = None) -> None:
    """qgZ: ``out_shard`` gets slice ``r`` (global rank ``r``) of the sum over all ranks of ``inp``
    (flat, ``world * out_shard.numel()`` elements), as
    :func:`~zeroshard.core.comm.collectives.reduce_scatter` lays it out; divided by the world size
    with ``average``. Blocking.

    Ranks are ``node * L + local`` (torchrun's order) with ``L`` ranks per node and ``N`` nodes:
    ``intra_group`` holds this node's ``L`` ranks, ``inter_group`` the ``N`` ranks with this rank's
    local index (``None``, or a group of one rank, when that level has one rank: the step is
    skipped without communicating). Two all-to-alls, DeepSpeed's hierarchical order:

    1. inside the node: each rank quantizes every ``s``-element slice of ``inp`` and sends local
       peer ``j`` the ``N`` slices of the ranks with local index ``j`` (``n * L + j`` for each node
       ``n``); the receiver dequantizes and sums the ``L`` pieces in fp32;
    2. across nodes: each rank quantizes its ``N`` partial sums and sends node ``n`` the one for
       rank ``n * L + local``; the receiver dequantizes and sums the ``N`` pieces in fp32.

    Each step is logged as one ``all_to_all_single`` of the quantized bytes it sends (payload plus
    scales). With ``bits`` 4 (DeepSpeed's), the inter-node step sends ``N * s / 2`` payload bytes per
    rank where a bf16 reduce-scatter of ``inp`` moves ``2 * N * L * s``: ``1 / (4 L)`` of it, plus
    ``2 / (L * block_size)`` for the scales. Error per element, with ``q = 2**(bits-1) - 1`` and
    ``a`` the absmax of each rank's block holding the element: at most ``sum(a) / (2q)`` from step 1
    plus ``(1 + 1/(2q)) * sum(a) / (2q)`` from step 2 (each step alone when the other is skipped).
    """
    _begin("quantized reduce-scatter")
    _check(block_size, bits)
    if intra_bits is not None:
        _check(block_size, intra_bits)
    local, nodes = _level(intra_group), _level(inter_group)
    s = out_shard.numel()
    if inp.numel() != nodes * local * s:
        raise ValueError(f"inp has {inp.numel()} elements; {nodes} nodes x {local} ranks of shards of {s} "
                         f"need {nodes * local * s}")
    chunks = inp.reshape(nodes, local, s)  # [node, local index, s]: rank n * L + j's slice at [n, j]
    if local > 1:
        assert intra_group is not None
        # [N, s]: the partial sums for (each node, my local index)
        partial = _exchange(chunks, intra_group, block_size, bits if intra_bits is None else intra_bits)
    else:
        partial = chunks[:, 0].to(_COMPUTE)
    if nodes > 1:
        assert inter_group is not None
        result = _exchange(partial.unsqueeze(0), inter_group, block_size, bits)[0]
    else:
        result = partial[0]
    if average:
        result = result / (nodes * local)
    out_shard.copy_(result.view(out_shard.shape))


#: qgZ's block for a bucket without 2-D gradients (DeepSpeed reduces those unquantized; a bucket
#: here mixes parameters, so it is quantized in blocks of this many elements)
QGZ_FALLBACK_BLOCK = 2048


def qgz_bucket_block_size(shapes: Sequence[Sequence[int]], world: int) -> int:
    """The qgZ block for a bucket of gradients of ``shapes``: DeepSpeed's group size
    (:func:`deepspeed_qgz_block_size`) of its largest 2-D gradient, which sets most of its bytes."""
    matrices = [tuple(s) for s in shapes if len(s) == 2]
    if not matrices:
        return QGZ_FALLBACK_BLOCK
    return deepspeed_qgz_block_size(max(matrices, key=lambda s: s[0] * s[1]), world)


@dataclass(frozen=True, eq=False)
class QuantizedReduction:
    """qgZ as a gradient sync uses it: the two levels' groups (:mod:`.topology`) and the bits."""

    #: this rank's node (``None``: one rank per node)
    intra: ProcessGroup | None
    #: the ranks with this rank's local index, one per node (``None``: one node)
    inter: ProcessGroup | None
    #: across nodes: DeepSpeed's 4 bits, where the bytes are dear
    bits: int = QGZ_BITS
    #: inside a node: 8 bits (DeepSpeed: 4). The fast links carry them cheaply, and 4 bits in both
    #: steps put the parameters of the test model 5.9e-2 from the reference after 20 steps on 2
    #: nodes x 2 (8 then 4 bits: see tests/distributed/test_zeropp.py)
    intra_bits: int = QWZ_BITS

    def reduce_rows(self, buf: torch.Tensor, block_size: int) -> torch.Tensor:
        """The sum over ranks of ``buf`` (laid out ``[world, n]``): this rank's row, fp32. Blocking."""
        world = _level(self.intra) * _level(self.inter)
        out = torch.empty(buf.numel() // world, dtype=_COMPUTE, device=buf.device)
        quantized_reduce_scatter(out, buf.view(-1), self.intra, self.inter, block_size, self.bits,
                                 intra_bits=self.intra_bits)
        return out
