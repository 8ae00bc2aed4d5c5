"""Peak FLOP/s of known accelerators, the denominator of the FLOPs profiler's MFU.

Dense (no sparsity) tensor-core peaks from the vendors' data sheets, for 16-bit compute (bf16 and
fp16 have the same peak on these parts). fp32 training has no entry: its peak depends on whether
TF32 is allowed (``torch.backends.cuda.matmul.allow_tf32``), so MFU there needs
``flops_profiler.peak_tflops`` in the config.
"""

from __future__ import annotations

import torch

#: (device-name substring, TFLOPS) for 16-bit dense matrix math; the first match wins, so the more
#: specific names come first
KNOWN_16BIT_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100", 989.4),  # SXM and the HGX boards
    ("H200", 989.4),
    ("GH200", 989.4),
    ("A100", 312.0),
)


def device_name(device: torch.device) -> str:
    """The accelerator's marketing name (``NVIDIA H200``), or ``cpu``."""
    if device.type == "cuda" and torch.cuda.is_available():
        return str(torch.cuda.get_device_name(device))
    return device.type


def known_peak_tflops(name: str, dtype: torch.dtype) -> float | None:
    """The dense peak of the device called ``name`` computing in ``dtype``, or ``None`` when unknown."""
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    return next((tflops for key, tflops in KNOWN_16BIT_TFLOPS if key in name), None)


def peak_flops(configured_tflops: float | None, device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """Peak FLOP/s per device for MFU and where it comes from: the config's ``peak_tflops`` first,
    then the table; ``(None, reason)`` when neither knows it."""
    if configured_tflops is not None:
        return configured_tflops * 1e12, "flops_profiler.peak_tflops"
    name = device_name(device)
    known = known_peak_tflops(name, dtype)
    if known is None:
        return None, f"unknown for {name} in {str(dtype).replace('torch.', '')}; set flops_profiler.peak_tflops"
    return known * 1e12, f"{name}, dense {str(dtype).replace('torch.', '')}"
