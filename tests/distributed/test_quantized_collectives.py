"""ZeRO++'s quantized collectives (:mod:`zeroshard.core.comm.quantized`) on real gloo ranks: world 4
as 2 nodes x 2 ranks, world 2 as 2 x 1 and 1 x 2 (a one-rank level given as ``None`` or as a group of
one rank).

qgZ (:func:`quantized_reduce_scatter`) is checked three ways: it equals, bit for bit, the same
algorithm replayed in one process from :func:`quantize_blockwise`/:func:`dequantize`; it is within
the error bound derived below of the exact sum (what a plain reduce-scatter computes); and the
bytes the communication logger sees are the quantized payloads plus scales of each step.

The bound. ``q = 2**(bits-1) - 1``; for an output element, ``a_r`` is the absmax of rank ``r``'s
block holding it (blocks are cut per shard, so every rank's block covers the same elements) and
``A = sum_r a_r / (2q)``. Step 1 (inside a node) errs by at most half a step per sender: ``A`` summed
over all senders. Step 2 quantizes partial sums whose block absmax is at most
``sum_local a * (1 + 1/(2q))``, so it adds at most ``A * (1 + 1/(2q))``. Both steps: ``A * (2 + 1/(2q))``;
one step skipped (2 x 1: step 1 is exact; 1 x 2: no step 2): ``A``. Plus fp32 rounding (``2**-20``
of the summed magnitudes) and, for a bf16 output, its rounding (``2**-8`` relative); divided by the
world size with ``average``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import run_distributed

from zeroshard.core.comm import collectives as C
from zeroshard.core.comm.quantized import dequantize, quantize_blockwise, quantized_all_gather, quantized_reduce_scatter

S = 1000  # elements of each rank's shard (not a multiple of any block size used)
#: qgZ cases: input dtype, bits, block size, average
QGZ = {"fp32-int4": (torch.float32, 4, 256, False),
       "bf16-int4-avg": (torch.bfloat16, 4, 256, True),
       "fp32-int8": (torch.float32, 8, 64, False)}
#: layouts per world size: (nodes, ranks per node, how a one-rank level is given)
LAYOUTS = {4: [(2, 2, "group")], 2: [(2, 1, "none"), (2, 1, "group"), (1, 2, "none"), (1, 2, "group")]}
SHARD = 1001  # qwZ shard size (odd)
#: qwZ cases: shard dtype, out dtype, bits, block size, async
QWZ = {"bf16-int8-bf16-async": (torch.bfloat16, torch.bfloat16, 8, 64, True),
       "fp32-int8-fp32-sync": (torch.float32, torch.float32, 8, 64, False),
       "bf16-int8-fp32-block8000": (torch.bfloat16, torch.float32, 8, 8000, True),
       "fp32-int4-fp32-async": (torch.float32, torch.float32, 4, 64, True)}


def grad_input(rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s flat input to the reduce-scatter: ``world`` shards of ``S``, of different
    magnitudes, zero at the head of every shard on every rank and in one block of rank 1."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(world, S, generator=g) * torch.logspace(-2, 1, world).unsqueeze(1) * (1 + rank)
    x[:, :8] = 0.0
    if rank == 1:
        x[:, 256:512] = 0.0
    return x.reshape(-1).to(dtype)


def shard_input(rank: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(200 + rank)
    x = torch.randn(SHARD, generator=g) * (1 + rank)
    x[:10] = 0.0
    return x.to(dtype)


class Recorder:
    """A communication logger that only notes what each collective says it moves."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def run(self, op: str, nbytes: int, device: torch.device, launch: Callable[[], Any], level: str = "") -> Any:
        self.calls.append((op, nbytes))
        return launch()  # no wait: the async paths stay async


def recorded(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, list[tuple[str, int]]]:
    """``fn(*args, **kwargs)`` and the collectives it logged."""
    rec = Recorder()
    C.HOOK.recorder = rec
    try:
        return fn(*args, **kwargs), rec.calls
    finally:
        C.HOOK.recorder = None


def _groups(rank: int, nodes: int, local: int, how: str) -> tuple[Any, Any]:
    """This rank's intra- and inter-node groups (every rank creates every group, in one order)."""
    intra = inter = None
    for n in range(nodes):
        ranks = [n * local + j for j in range(local)]
        if local > 1 or how == "group":
            g = dist.new_group(ranks)
            intra = g if rank in ranks else intra
    for j in range(local):
        ranks = [n * local + j for n in range(nodes)]
        if nodes > 1 or how == "group":
            g = dist.new_group(ranks)
            inter = g if rank in ranks else inter
    return intra, inter


def worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for nodes, local, how in LAYOUTS[world]:
        intra, inter = _groups(rank, nodes, local, how)
        for name, (dtype, bits, block, average) in QGZ.items():
            res = torch.full((S,), float("nan"), dtype=dtype)
            inp = grad_input(rank, world, dtype)
            _, calls = recorded(quantized_reduce_scatter, res, inp, intra, inter, block, bits, average=average)
            out[f"qgz/{nodes}x{local}-{how}/{name}"] = {"out": res, "calls": calls}
    plain = torch.empty(S, dtype=torch.bfloat16)
    _, calls = recorded(C.reduce_scatter, plain, grad_input(rank, world, torch.bfloat16), None, async_op=False)
    out["plain_rs_bf16"] = {"calls": calls}
    plain32 = torch.empty(S)
    C.reduce_scatter(plain32, grad_input(rank, world, torch.float32), None, async_op=False)
    out["plain_rs_fp32"] = {"out": plain32}

    for name, (sdtype, odtype, bits, block, async_op) in QWZ.items():
        gathered = torch.full((world * SHARD,), float("nan"), dtype=odtype)
        handle, calls = recorded(quantized_all_gather, gathered, shard_input(rank, sdtype), None, block,
                                 async_op=async_op, bits=bits)
        if async_op:
            assert handle is not None and handle.wait() is gathered and handle.wait() is gathered
        else:
            assert handle is None
        out[f"qwz/{name}"] = {"out": gathered, "calls": calls}
    plain_ag = torch.empty(world * SHARD, dtype=torch.bfloat16)
    _, calls = recorded(C.all_gather, plain_ag, shard_input(rank, torch.bfloat16), None, async_op=False)
    out["plain_ag_bf16"] = {"calls": calls}
    return out


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict[str, Any]]]:
    return {world: run_distributed(worker, world, timeout=240) for world in (4, 2)}


# -- the reference, in one process ----------------------------------------------------------------

def _round_trip(v: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    return dequantize(quantize_blockwise(v, block, bits))


def simulate(world: int, nodes: int, local: int, dtype: torch.dtype, bits: int, block: int,
             average: bool) -> list[torch.Tensor]:
    """qgZ replayed from quantize_blockwise/dequantize: every rank's output."""
    chunks = [grad_input(r, world, dtype).view(world, S) for r in range(world)]
    partial: dict[int, list[torch.Tensor]] = {}
    for n in range(nodes):
        for j in range(local):
            rows = []
            for m in range(nodes):
                c = m * local + j
                if local > 1:
                    rows.append(torch.stack([_round_trip(chunks[n * local + i][c], block, bits)
                                             for i in range(local)]).sum(0))
                else:
                    rows.append(chunks[n * local][c].float())
            partial[n * local + j] = rows
    outs = []
    for n in range(nodes):
        for j in range(local):
            if nodes > 1:
                res = torch.stack([_round_trip(partial[m * local + j][n], block, bits) for m in range(nodes)]).sum(0)
            else:
                res = partial[j][0]
            outs.append((res / world if average else res).to(dtype))
    return outs


def exact_sum(world: int, dtype: torch.dtype) -> torch.Tensor:
    """``[world, S]``: row r is rank r's slice of the exact sum."""
    return torch.stack([grad_input(r, world, dtype).double().view(world, S) for r in range(world)]).sum(0)


def error_bound(world: int, nodes: int, local: int, dtype: torch.dtype, bits: int, block: int,
                average: bool) -> torch.Tensor:
    """``[world, S]``: the bound stated in the module docstring, per output element."""
    q = 2 ** (bits - 1) - 1
    blocks = -(-S // block)
    total = torch.zeros(world, S, dtype=torch.float64)
    magnitude = torch.zeros(world, S, dtype=torch.float64)
    for r in range(world):
        x = grad_input(r, world, dtype).double().view(world, S)
        padded = torch.nn.functional.pad(x, (0, blocks * block - S)).view(world, blocks, block)
        total += padded.abs().amax(dim=2).repeat_interleave(block, dim=1)[:, :S]
        magnitude += x.abs()
    a = total / (2 * q)
    bound = a * (2 + 1 / (2 * q)) if nodes > 1 and local > 1 else a
    bound = bound + magnitude * 2**-20
    return bound / world if average else bound


def _qgz_cases() -> list[tuple[int, int, int, str, str]]:
    return [(world, nodes, local, how, name) for world, layouts in LAYOUTS.items()
            for nodes, local, how in layouts for name in QGZ]


def _quantized_bytes(numel: int, block: int, bits: int) -> int:
    """Payload (``bits`` per element, no padding) plus one fp32 scale per block."""
    return -(-numel * bits // 8) + 4 * -(-numel // block)


# -- qgZ ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world,nodes,local,how,name", _qgz_cases())
def test_quantized_reduce_scatter(runs: dict[int, list[dict[str, Any]]], world: int, nodes: int, local: int,
                                  how: str, name: str) -> None:
    dtype, bits, block, average = QGZ[name]
    results = [r[f"qgz/{nodes}x{local}-{how}/{name}"]["out"] for r in runs[world]]
    # the same algorithm replayed in one process: identical bits
    for r, (got, want) in enumerate(zip(results, simulate(world, nodes, local, dtype, bits, block, average))):
        assert torch.equal(got, want), f"rank {r}"
    # within the bound of the exact sum, which the plain fp32 reduce-scatter also matches
    exact = exact_sum(world, dtype) / (world if average else 1)
    plain = torch.stack([r["plain_rs_fp32"]["out"] for r in runs[world]]).double()
    if dtype == torch.float32:
        torch.testing.assert_close(plain, exact, rtol=1e-5, atol=1e-5)
    got = torch.stack(results).double()
    bound = error_bound(world, nodes, local, dtype, bits, block, average)
    if dtype == torch.bfloat16:
        bound = bound + got.abs() * 2**-8
    err = (got - exact).abs()
    assert bool((err <= bound).all()), f"worst error / bound {float((err / bound).max()):.3f}"
    assert bool((got[:, :8] == 0).all())  # zero on every rank: exactly zero
    print(f"qgZ {world} ranks as {nodes}x{local} ({how}) {name}: max error {float(err.max()):.4g} "
          f"= {float(err.max() / exact.abs().max()):.3%} of max |sum|, worst error / bound "
          f"{float((err / bound).max()):.3f}")


@pytest.mark.parametrize("world,nodes,local,how,name", _qgz_cases())
def test_quantized_reduce_scatter_bytes(runs: dict[int, list[dict[str, Any]]], world: int, nodes: int,
                                        local: int, how: str, name: str) -> None:
    _, bits, block, _ = QGZ[name]
    per_shard = _quantized_bytes(S, block, bits)  # payload + scales of one S-element slice
    expected = []
    if local > 1:
        expected.append(("all_to_all_single", nodes * local * per_shard))  # step 1: every slice, by local peer
    if nodes > 1:
        expected.append(("all_to_all_single", nodes * per_shard))  # step 2: one partial sum per node
    for r in runs[world]:
        assert r[f"qgz/{nodes}x{local}-{how}/{name}"]["calls"] == expected
    plain_bf16 = runs[world][0]["plain_rs_bf16"]["calls"]
    assert plain_bf16 == [("reduce_scatter_tensor", 2 * world * S)]
    if nodes > 1:
        ratio = nodes * per_shard / (2 * world * S)
        # bits/16 per rank of the node, plus the scales: at 4 bits 1/(4L) + 2/(L * block),
        # 0.258 for 2x1 and 0.129 for 2x2 with 1000-element shards in blocks of 256
        assert ratio == pytest.approx(bits / 16 / local + 2 / (local * block), rel=0.03)
        if bits == 4:
            assert ratio <= 0.3
        print(f"qgZ {nodes}x{local} {name}: inter-node bytes {nodes * per_shard} / plain bf16 reduce-scatter "
              f"{2 * world * S} = {ratio:.3f}")


# -- qwZ ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [4, 2])
@pytest.mark.parametrize("name", list(QWZ))
def test_quantized_all_gather(runs: dict[int, list[dict[str, Any]]], world: int, name: str) -> None:
    sdtype, odtype, bits, block, _ = QWZ[name]
    shards = [shard_input(r, sdtype) for r in range(world)]
    plain = torch.cat(shards).double()
    q = 2 ** (bits - 1) - 1
    blocks = -(-SHARD // block)
    bound = torch.cat([torch.nn.functional.pad(s.double().abs(), (0, blocks * block - SHARD)).view(blocks, block)
                       .amax(dim=1).repeat_interleave(block)[:SHARD] / (2 * q) for s in shards])
    bound = bound + plain.abs() * 2**-21
    if odtype == torch.bfloat16:
        bound = bound + plain.abs() * 2**-8
    want = torch.cat([dequantize(quantize_blockwise(s, block, bits), dtype=odtype) for s in shards])
    for r in runs[world]:
        got = r[f"qwz/{name}"]["out"]
        assert got.dtype == odtype and torch.equal(got, want)
        err = (got.double() - plain).abs()
        assert bool((err <= bound).all()), float((err / bound).max())
        assert bool((got.view(world, SHARD)[:, :10] == 0).all())
        assert r[f"qwz/{name}"]["calls"] == [("all_gather_into_tensor", world * _quantized_bytes(SHARD, block, bits))]
    ratio = _quantized_bytes(SHARD, block, bits) / (2 * SHARD)
    assert runs[world][0]["plain_ag_bf16"]["calls"] == [("all_gather_into_tensor", 2 * world * SHARD)]
    print(f"qwZ {world} ranks {name}: max error / bound {float((err / bound).max()):.3f}, "
          f"bytes / plain bf16 all-gather {ratio:.3f}")
    assert ratio <= (0.55 if bits == 8 else 0.3)
    if bits == 8 and block == 64:
        assert math.isclose(ratio, (1001 + 4 * 16) / 2002)
