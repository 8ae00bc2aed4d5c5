"""DeepSpeed's ZeRO memory estimators: same names, signatures, numbers and printed tables.

These are DeepSpeed 0.19's ``estimate_zero2_model_states_mem_needs*`` (``runtime/zero/
stage_1_and_2.py``, for stages 1 and 2) and ``estimate_zero3_model_states_mem_needs*``
(``runtime/zero/stage3.py``), re-implemented without DeepSpeed. They estimate *model states*
only (parameters, gradients, optimizer states; no activations, no buffers) for mixed-precision
Adam, with DeepSpeed's residency, including its CPU offload. zeroshard's own estimate, which
follows zeroshard's residency (CPU and NVMe offload included) and adds activations, is
:func:`zeroshard.estimate.estimate`.

Two deliberate differences, neither changing a number:

- shared parameters are counted once by identity as well as by address, so a model built on the
  meta device (where every tensor's address is 0) is counted correctly;
- the option column prints ``offload_optimizer=cpu `` as DeepSpeed's documentation shows it
  (DeepSpeed itself prints ``OffloadDeviceEnum.cpu`` on Python >= 3.11, where enum formatting changed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "zero2_model_to_params",
    "zero3_model_to_params",
]

_CPU = f"{'cpu':4}"  # DeepSpeed pads the device name to 4 characters


def estimate_zero2_model_states_mem_needs(total_params: int | float, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                          cpu_offload: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """DeepSpeed's ZeRO-2 (and ZeRO-1) estimate of model-state memory.

    Args:
        total_params: parameters of the model.
        num_gpus_per_node: accelerators per node.
        num_nodes: nodes.
        cpu_offload: whether the optimizer is offloaded to CPU (``offload_optimizer.device: cpu``).
        additional_buffer_factor: DeepSpeed's safety factor on CPU memory.

    Returns:
        ``(cpu_bytes_per_node, gpu_bytes_per_gpu)``: with offload 2Ψ on the GPU (16-bit params) and
        ``Ψ·max(4·GPUs, 16)·factor`` on the CPU; without, ``2Ψ + 18Ψ/GPUs`` on the GPU (16-bit and
        fp32 gradients, fp32 master, Adam's two moments) and ``4Ψ·GPUs per node·factor`` on the CPU.
    """
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def estimate_zero3_model_states_mem_needs(total_params: int | float, largest_layer_params: int | float,
                                          num_gpus_per_node: int = 1, num_nodes: int = 1, cpu_offload: bool = True,
                                          cpu_offload_params: bool = True, zero_init: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[int, int, int | float]:
    """DeepSpeed's ZeRO-3 estimate of model-state memory.

    Args:
        total_params: parameters of the model.
        largest_layer_params: parameters of the largest module (its direct parameters).
        num_gpus_per_node: accelerators per node.
        num_nodes: nodes.
        cpu_offload: optimizer offloaded to CPU.
        cpu_offload_params: parameters offloaded to CPU (only meaningful with ``cpu_offload``).
        zero_init: the model is built under ``zero.Init`` (partitioned while constructed).
        additional_buffer_factor: DeepSpeed's safety factor on CPU memory.

    Returns:
        ``(cpu_bytes_per_node, gpu_bytes_per_gpu, largest_layer_bytes)``, the last being
        ``4·largest_layer_params`` (the gathered largest layer, which every row includes on the GPU).
    """
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        # on the CPU: master 4 + Adam 8 + gradients 4 bytes a parameter, and the 16-bit parameters (2) if offloaded
        on_cpu = 18 if cpu_offload_params else 16
        gpu_mem = largest_layer_memory + (0 if cpu_offload_params else int(2 * total_params / total_gpus))
        if zero_init:
            cpu_mem = total_params * on_cpu * gpus_factor * additional_buffer_factor
        else:
            cpu_mem = total_params * max(4 * num_gpus_per_node, on_cpu * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


def _unique_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters of ``model``, a tensor shared by several modules (or aliased storage) once."""
    out, seen = [], set()
    for p in model.parameters():
        key = ("id", id(p)) if p.device.type == "meta" else ("ptr", p.data_ptr())
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def zero2_model_to_params(model: torch.nn.Module) -> int:
    """DeepSpeed's ``stage_1_and_2.model_to_params``: the model's parameter count, shared ones once."""
    return sum(p.numel() for p in _unique_params(model))


def zero3_model_to_params(model: torch.nn.Module) -> tuple[int, int]:
    """DeepSpeed's ``stage3.model_to_params``: ``(total_params, largest_layer_params)``, the
    largest layer being the most direct parameters of any one module."""
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return zero2_model_to_params(model), largest


def _header(total_params: int | float, num_gpus_per_node: int, num_nodes: int, largest: int | float | None) -> None:
    nodes_str = "nodes" if num_nodes > 1 else "node"
    gpus_str = "GPUs" if num_gpus_per_node > 1 else "GPU"
    layer = "" if largest is None else f", {int(largest / 1e6)}M largest layer params"
    print("Estimated memory needed for params, optim states and gradients for a:\n"
          f"HW: Setup with {num_nodes} {nodes_str}, {num_gpus_per_node} {gpus_str} per node.\n"
          f"SW: Model with {int(total_params / 1e6)}M total params{layer}.")
    print("  per CPU  |  per GPU |   Options")


def _row(cpu_mem: int, gpu_mem: int | float, options: str) -> None:
    print(f" {cpu_mem / 2**30:7.2f}GB | {gpu_mem / 2**30:6.2f}GB | {options}")


def estimate_zero2_model_states_mem_needs_all_live(model: torch.nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> None:
    """Print DeepSpeed's ZeRO-2 estimate for an actual ``model`` (it may live on the meta device).

    For a hypothetical model use :func:`estimate_zero2_model_states_mem_needs_all_cold`.
    """
    estimate_zero2_model_states_mem_needs_all_cold(zero2_model_to_params(model), num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)


def estimate_zero2_model_states_mem_needs_all_cold(total_params: int | float, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> None:
    """Print DeepSpeed's ZeRO-2 estimate (bytes per CPU node and per GPU) with and without
    optimizer offload, for a model of ``total_params`` parameters."""
    _header(total_params, num_gpus_per_node, num_nodes, None)
    for cpu_offload in (True, False):
        cpu_mem, gpu_mem = estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node, num_nodes,
                                                                 cpu_offload, additional_buffer_factor)
        _row(cpu_mem, gpu_mem, f"offload_optimizer={_CPU if cpu_offload else 'none'}")


def estimate_zero3_model_states_mem_needs_all_live(model: torch.nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> None:
    """Print DeepSpeed's ZeRO-3 estimate for an actual ``model`` (it may live on the meta device).

    For a hypothetical model use :func:`estimate_zero3_model_states_mem_needs_all_cold`.
    """
    total_params, largest_layer_params = zero3_model_to_params(model)
    estimate_zero3_model_states_mem_needs_all_cold(total_params, largest_layer_params, num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)


def zero3_options() -> list[tuple[bool, bool, bool]]:
    """DeepSpeed's rows of the ZeRO-3 table: ``(offload optimizer, offload params, zero_init)``."""
    return [(opt, par, init) for opt in (True, False) for par in (True, False) if opt or not par
            for init in (True, False)]


def estimate_zero3_model_states_mem_needs_all_cold(total_params: int | float, largest_layer_params: int | float,
                                                   num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print DeepSpeed's ZeRO-3 estimate (bytes per CPU node and per GPU) for every combination of
    parameter offload, optimizer offload and ``zero.Init``, for a hypothetical model."""
    _header(total_params, num_gpus_per_node, num_nodes, largest_layer_params)
    for cpu_offload, cpu_offload_params, zero_init in zero3_options():
        cpu_mem, gpu_mem, _ = estimate_zero3_model_states_mem_needs(
            total_params, largest_layer_params, num_gpus_per_node, num_nodes, cpu_offload, cpu_offload_params,
            zero_init, additional_buffer_factor)
        options = (f"offload_param={_CPU if cpu_offload_params else 'none'}, "
                   f"offload_optimizer={_CPU if cpu_offload else 'none'}, zero_init={1 if zero_init else 0}")
        _row(cpu_mem, gpu_mem, options)
