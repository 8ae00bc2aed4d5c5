"""The accelerator objects behind :func:`get_accelerator`: CUDA, or the CPU.

Method names, arguments and return values follow DeepSpeed 0.19's ``DeepSpeedAccelerator``
(``deepspeed/accelerator/abstract_accelerator.py``, ``cuda_accelerator.py``, ``cpu_accelerator.py``),
except that the CPU backend is ``gloo`` (DeepSpeed's CPU accelerator says ``ccl``), the one zeroshard
uses on CPUs.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from zeroshard.errors import NotYetSupportedError

#: DeepSpeed accelerator methods zeroshard does not offer, with the reason.
UNSUPPORTED: dict[str, str] = {
    **dict.fromkeys(("create_graph", "capture_to_graph", "replay_graph", "is_current_stream_capturing"),
                    "graph capture is not offered"),
    **dict.fromkeys(("op_builder_dir", "create_op_builder", "get_op_builder", "build_extension"),
                    "zeroshard compiles no custom ops"),
    **dict.fromkeys(("is_triton_supported", "prefer_triton_grouped_mm"), "zeroshard uses no Triton kernels"),
    **dict.fromkeys(("lazy_call", "register_host_memory", "unregister_host_memory", "pin_empty",
                     "pin_empty_like", "unpin_memory", "pin_memory_alignment", "set_compile_backend",
                     "export_envs", "visible_devices_envs", "set_visible_devices_envs",
                     "communication_backend_version"), "not offered by zeroshard's accelerator"),
}


class Accelerator:
    """What both accelerators share; subclasses set :attr:`_name` and :attr:`_backend`."""

    _name = ""
    _backend = ""

    def __getattr__(self, name: str) -> Any:
        if name in UNSUPPORTED:
            raise NotYetSupportedError(f"get_accelerator().{name}() is not supported: {UNSUPPORTED[name]}", key=name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    # -- identity --------------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"``/``"cuda:N"`` or ``"cpu"``."""
        return self._name if device_index is None or self._name == "cpu" else f"{self._name}:{device_index}"

    def communication_backend_name(self) -> str:
        """``"nccl"`` on CUDA, ``"gloo"`` on the CPU."""
        return self._backend

    def is_synchronized_device(self) -> bool:
        """Whether work completes when issued (the CPU)."""
        return self._name == "cpu"

    def use_host_timers(self) -> bool:
        """Whether host timers measure device work (synchronized devices)."""
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        """As DeepSpeed: synchronized devices do."""
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        """As DeepSpeed: synchronized devices do."""
        return self.is_synchronized_device()

    def is_fp64_supported(self) -> bool:
        """True."""
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        """The floating dtypes training may use."""
        return [torch.float32] + [d for d, ok in ((torch.float16, self.is_fp16_supported()),
                                                  (torch.bfloat16, self.is_bf16_supported())) if ok]

    def is_bf16_supported(self) -> bool:
        """Whether bf16 works here."""
        raise NotImplementedError

    def is_fp16_supported(self) -> bool:
        """Whether fp16 works here."""
        raise NotImplementedError

    # -- random numbers ----------------------------------------------------------------------------
    def random(self) -> Any:
        """``torch.random``."""
        return torch.random

    def manual_seed(self, seed: int) -> Any:
        """Seed this device's generator."""
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        """Seed every device's generator."""
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        """The seed of the default generator."""
        return int(torch.initial_seed())

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """The generator state."""
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        """Restore a generator state."""
        torch.set_rng_state(new_state)

    @property
    def default_generator(self) -> Any:
        """``torch.default_generator`` (CUDA: the device's)."""
        return torch.default_generator

    # -- tensors -------------------------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """Page-locked copy of ``tensor`` when an accelerator exists, else ``tensor``."""
        return tensor.pin_memory() if torch.cuda.is_available() else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is page-locked."""
        return bool(tensor.is_pinned()) if torch.cuda.is_available() else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this accelerator's device type."""
        return tensor.device.type == self._name

    def range_push(self, msg: str) -> None:
        """Open a profiler range (NVTX on CUDA; nothing on the CPU)."""

    def range_pop(self) -> None:
        """Close the last profiler range."""

    def get_compile_backend(self) -> str:
        """``"inductor"``, torch.compile's default."""
        return "inductor"

    # DeepSpeed's tensor-type properties
    BFloat16Tensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.bfloat16, device=self._name))
    ByteTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.uint8, device=self._name))
    DoubleTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.float64, device=self._name))
    FloatTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.float32, device=self._name))
    HalfTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.float16, device=self._name))
    IntTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.int32, device=self._name))
    LongTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.int64, device=self._name))


class CudaAccelerator(Accelerator):
    """CUDA through ``torch.cuda``."""

    _name = "cuda"
    _backend = "nccl"

    def device(self, device_index: int | None = None) -> torch.device:
        """``torch.device("cuda", index)``."""
        return torch.device("cuda") if device_index is None else torch.device("cuda", device_index)

    def set_device(self, device_index: int) -> None:
        """Make ``device_index`` current."""
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        """The current device index."""
        return int(torch.cuda.current_device())

    def current_device_name(self) -> str:
        """``"cuda:N"`` of the current device."""
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        """Visible GPUs."""
        return int(torch.cuda.device_count())

    def is_available(self) -> bool:
        """Whether CUDA works."""
        return bool(torch.cuda.is_available())

    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for queued work."""
        torch.cuda.synchronize(device_index)

    def manual_seed(self, seed: int) -> Any:
        """Seed the current GPU's generator."""
        return torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        """Seed every GPU's generator."""
        return torch.cuda.manual_seed_all(seed)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """The GPU generator state."""
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        """Restore a GPU generator state."""
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    @property
    def default_generator(self) -> Any:
        """The default generators of the GPUs (a tuple, as ``torch.cuda.default_generators``)."""
        return torch.cuda.default_generators

    def is_bf16_supported(self) -> bool:
        """``torch.cuda.is_bf16_supported()``."""
        return bool(torch.cuda.is_bf16_supported())

    def is_fp16_supported(self) -> bool:
        """True on any GPU torch supports."""
        return True

    def empty_cache(self) -> None:
        """Return cached blocks to the driver."""
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes allocated by tensors."""
        return int(torch.cuda.memory_allocated(device_index))

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Peak bytes allocated."""
        return int(torch.cuda.max_memory_allocated(device_index))

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        """Reset the allocation peak."""
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        """Bytes reserved by the caching allocator."""
        return int(torch.cuda.memory_reserved(device_index))

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        """Peak bytes reserved."""
        return int(torch.cuda.max_memory_reserved(device_index))

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved
    reset_max_memory_cached = reset_max_memory_allocated

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """Reset every peak counter."""
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        """The caching allocator's statistics."""
        return dict(torch.cuda.memory_stats(device_index))

    def total_memory(self, device_index: int | None = None) -> int:
        """Bytes of device memory."""
        return int(torch.cuda.get_device_properties(device_index or 0).total_memory)

    def available_memory(self, device_index: int | None = None) -> int:
        """Free bytes on the device."""
        return int(torch.cuda.mem_get_info(device_index)[0])

    def Stream(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - DeepSpeed's name
        """``torch.cuda.Stream``."""
        return torch.cuda.Stream(*args, **kwargs)

    def stream(self, stream: Any) -> Any:
        """``torch.cuda.stream(stream)`` context."""
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        """The current stream."""
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> Any:
        """The default stream."""
        return torch.cuda.default_stream(device_index)

    def Event(self, **kwargs: Any) -> Any:  # noqa: N802 - DeepSpeed's name
        """``torch.cuda.Event``."""
        return torch.cuda.Event(**kwargs)

    def range_push(self, msg: str) -> None:
        """Open an NVTX range."""
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        """Close the last NVTX range."""
        torch.cuda.nvtx.range_pop()


class CpuAccelerator(Accelerator):
    """The CPU: training with gloo, memory counted as the process's resident set."""

    _name = "cpu"
    _backend = "gloo"

    def device(self, device_index: int | None = None) -> torch.device:
        """``torch.device("cpu")`` (DeepSpeed's CPU accelerator returns None)."""
        return torch.device("cpu")

    def set_device(self, device_index: int) -> None:
        """Nothing to select."""

    def current_device(self) -> int:
        """The launcher's ``LOCAL_RANK`` (as DeepSpeed's CPU accelerator)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        """``"cpu"``."""
        return "cpu"

    def device_count(self) -> int:
        """Processes per node the launcher started (``LOCAL_SIZE``/``LOCAL_WORLD_SIZE``), else 1."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))

    def is_available(self) -> bool:
        """True."""
        return True

    def synchronize(self, device_index: int | None = None) -> None:
        """Nothing to wait for."""

    def is_bf16_supported(self) -> bool:
        """True: torch computes bf16 on any CPU."""
        return True

    def is_fp16_supported(self) -> bool:
        """True: torch computes fp16 on the CPU (slowly on most)."""
        return True

    def empty_cache(self) -> None:
        """Nothing is cached."""

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Resident bytes of the process (DeepSpeed's CPU accelerator: the same)."""
        return _rss_bytes()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Peak resident bytes of the process."""
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        """The kernel's peak cannot be reset."""

    memory_reserved = memory_allocated
    max_memory_reserved = max_memory_allocated
    memory_cached = memory_allocated
    max_memory_cached = max_memory_allocated
    reset_max_memory_cached = reset_max_memory_allocated
    reset_peak_memory_stats = reset_max_memory_allocated

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        """``{"allocated_bytes.all.current": RSS, "allocated_bytes.all.peak": peak RSS}``."""
        return {"allocated_bytes.all.current": self.memory_allocated(),
                "allocated_bytes.all.peak": self.max_memory_allocated()}

    def total_memory(self, device_index: int | None = None) -> int:
        """Bytes of physical memory."""
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    def available_memory(self, device_index: int | None = None) -> int:
        """Bytes of memory available to new allocations."""
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@functools.cache
def get_accelerator() -> Accelerator:
    """The accelerator of this process: CUDA when torch sees a GPU, else the CPU."""
    return CudaAccelerator() if torch.cuda.is_available() else CpuAccelerator()
