"""Block-wise symmetric quantization (:mod:`zeroshard.core.comm.quantized`), in one process: the
round-trip error is at most half a step of each block, sizes need not divide the block, zeros stay
zero, and the bytes are what ZeRO++ promises (int8 about half of bf16, int4 a quarter)."""

from __future__ import annotations

import pytest
import torch

from zeroshard.core.comm.quantized import (
    QWZ_TARGET_BLOCK,
    Quantized,
    deepspeed_qgz_block_size,
    deepspeed_qwz_block_size,
    dequantize,
    quantize_blockwise,
)


def _step_per_element(q: Quantized) -> torch.Tensor:
    return q.scales.repeat_interleave(q.block_size)[: q.numel]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel,block", [(4096, 256), (1001, 64), (7, 16), (130, 2), (999, 7)])
def test_round_trip_within_half_a_step(bits: int, dtype: torch.dtype, numel: int, block: int) -> None:
    g = torch.Generator().manual_seed(numel + bits)
    x = (torch.randn(numel, generator=g) * torch.logspace(-3, 2, numel)).to(dtype)  # blocks of different scales
    q = quantize_blockwise(x, block, bits)
    qmax = 2 ** (bits - 1) - 1
    blocks = -(-numel // block)
    assert q.scales.dtype == torch.float32 and q.scales.shape == (blocks,)
    assert q.numel == numel and q.dtype == dtype and q.bits == bits and q.block_size == block
    # the scale is the block's absmax over the largest code
    padded = torch.nn.functional.pad(x.float(), (0, blocks * block - numel)).view(blocks, block)
    torch.testing.assert_close(q.scales, padded.abs().amax(dim=1) / qmax, rtol=0, atol=0)
    y = dequantize(q)
    assert y.dtype == torch.float32 and y.shape == (numel,)
    err = (y - x.float()).abs()
    step = _step_per_element(q)
    # half a step, plus the fp32 rounding of x / step and of code * step (a few ulps of x)
    assert bool((err <= step / 2 + x.float().abs() * 2**-21).all()), float((err / step).max())
    assert float((err / step.clamp_min(1e-30)).max()) <= 0.5 + 1e-4
    # the block's extreme value is a code, so it comes back exactly (up to the fp32 product)
    torch.testing.assert_close(y.abs().max(), x.float().abs().max(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("bits", [8, 4])
def test_dequantize_into_out_and_dtype(bits: int) -> None:
    x = torch.randn(3, 50, dtype=torch.bfloat16)
    q = quantize_blockwise(x, 32, bits)
    out = torch.empty(3, 50, dtype=torch.bfloat16)
    assert dequantize(q, out=out) is out
    ref = dequantize(q)
    assert torch.equal(out.view(-1), ref.to(torch.bfloat16))
    assert dequantize(q, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="elements"):
        dequantize(q, out=torch.empty(149))


@pytest.mark.parametrize("bits", [8, 4])
def test_zeros_stay_zero(bits: int) -> None:
    x = torch.randn(300)
    x[::3] = 0.0
    x[128:192] = 0.0  # a whole block of zeros: scale 0, no division by zero
    q = quantize_blockwise(x, 64, bits)
    assert q.scales[2] == 0
    y = dequantize(q)
    assert bool((y[x == 0] == 0).all()) and not bool(y.isnan().any())
    z = quantize_blockwise(torch.zeros(100), 64, bits)
    assert bool((z.scales == 0).all()) and bool((dequantize(z) == 0).all())
    empty = quantize_blockwise(torch.zeros(0), 64, bits)
    assert empty.nbytes == 0 and dequantize(empty).numel() == 0


def test_non_finite_poisons_its_block_only() -> None:
    x = torch.randn(64)
    x[3], x[40] = float("inf"), float("nan")
    y = dequantize(quantize_blockwise(x, 16, 8))
    assert bool(y[0:16].isnan().all()) and bool(y[32:48].isnan().all())
    assert bool(y[16:32].isfinite().all()) and bool(y[48:].isfinite().all())


def test_codes_are_exact_integers_of_the_step() -> None:
    for bits in (8, 4):
        qmax = 2 ** (bits - 1) - 1
        x = torch.arange(-qmax, qmax + 1, dtype=torch.float32)
        assert torch.equal(dequantize(quantize_blockwise(x, 2 * qmax + 2, bits)), x)
    # round half to even, like DeepSpeed's __float2int_rn: 127 * [0.5, 1.5, 2.5] / 127 steps
    x = torch.tensor([0.5, 1.5, 2.5, 127.0])
    assert torch.equal(dequantize(quantize_blockwise(x, 4, 8)), torch.tensor([0.0, 2.0, 2.0, 127.0]))


def test_int8_payload_is_int8() -> None:
    q = quantize_blockwise(torch.randn(1000), 100, 8)
    assert q.payload.dtype == torch.int8 and q.payload.numel() == 1000 and q.nbytes == 1000 + 4 * 10
    short = quantize_blockwise(torch.randn(1001), 8000, 8)  # smaller than one block: no padding sent
    assert short.payload.numel() == 1001 and short.nbytes == 1001 + 4
    assert int(q.payload.min()) >= -127 and int(q.payload.max()) <= 127


def test_int4_packs_two_values_per_byte() -> None:
    x = torch.tensor([-7.0, 7.0, 1.0, -1.0, 0.0, 3.0])
    q = quantize_blockwise(x, 6, 4)
    assert q.payload.dtype == torch.uint8 and q.payload.numel() == 3
    # code 2i in the low nibble, 2i+1 in the high one, both two's complement
    assert q.payload.tolist() == [(-7 & 0xF) | (7 << 4), 1 | ((-1 & 0xF) << 4), 0 | (3 << 4)]
    assert torch.equal(dequantize(q), x)
    big = quantize_blockwise(torch.randn(10_000), 1000, 4)
    assert big.payload.numel() * 2 == 10_000 and big.nbytes == 5_000 + 4 * 10
    odd = torch.tensor([1.0, -2.0, 3.0, -4.0, 5.0, -6.0, 7.0])  # odd count, odd block: one zero nibble at the end
    q = quantize_blockwise(odd, 3, 4)
    assert q.payload.numel() == 4 and q.payload[3] >> 4 == 0 and q.scales.numel() == 3
    assert float((dequantize(q) - odd).abs().max()) <= float(q.scales.max()) / 2


def test_byte_counts_against_bf16() -> None:
    numel = 4096 * 1024 // 8  # a rank's partition of a 4096 x 1024 weight over 8 ranks
    block = deepspeed_qwz_block_size(numel)
    assert block <= QWZ_TARGET_BLOCK and numel % block == 0 and block % 8 == 0
    x = torch.randn(numel, dtype=torch.bfloat16)
    q8 = quantize_blockwise(x, block, 8)
    ratio8 = q8.nbytes / (2 * numel)
    assert ratio8 <= 0.55
    assert q8.nbytes == numel + 4 * (numel // block)
    q4 = quantize_blockwise(x, block, 4)
    assert q4.nbytes / (2 * numel) <= 0.26
    # a block of 64 still keeps int8 under 0.55x of bf16: (1 + 4/64) / 2 = 0.53
    assert quantize_blockwise(x, 64, 8).nbytes / (2 * numel) == pytest.approx(0.53125)


def test_deepspeed_block_sizes() -> None:
    # CUDAQuantizer: the fewest groups from ceil(numel / 8000) up whose size is a multiple of 8 dividing numel
    assert deepspeed_qwz_block_size(8000) == 8000
    assert deepspeed_qwz_block_size(16000) == 8000
    assert deepspeed_qwz_block_size(4096 * 4096) == 4096  # 2098 groups wanted; 4096 is the first that fits
    assert deepspeed_qwz_block_size(1 << 20) == 4096  # 2**20 / 8000 -> 132 groups; 256 is the first that fits
    assert deepspeed_qwz_block_size(1001) == QWZ_TARGET_BLOCK  # not a multiple of 8: DeepSpeed asserts, we pad
    # qgZ: numel / max(rows, cols, world)
    assert deepspeed_qgz_block_size((4096, 11008), 64) == 4096
    assert deepspeed_qgz_block_size((16, 16), 64) == 4
    with pytest.raises(ValueError, match="2-D"):
        deepspeed_qgz_block_size((10,), 4)


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="bits"):
        quantize_blockwise(torch.randn(8), 4, bits=2)
    with pytest.raises(ValueError, match="positive"):
        quantize_blockwise(torch.randn(8), 0)
    with pytest.raises(TypeError, match="floating"):
        quantize_blockwise(torch.arange(8), 4)
