"""The CPU platform: always available, the fallback when no accelerator is found."""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from chassis.platforms.interface import Platform
from chassis.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from chassis.core.config import EngineConfig
    from chassis.core.layers.kernels import LayerKernels
    from chassis.platforms.cpu_packed_linear import PackedLinear

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 4 * 1024**3


def cpu_flags() -> set[str]:
    """The processor's feature flags from /proc/cpuinfo (empty where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def has_fast_bf16() -> bool:
    """Whether bf16 matmuls run natively (AVX512-BF16 or AMX), which makes bf16 the default."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


#: marks a not-yet-resolved lazy attribute (``None`` is a valid resolved value)
_UNRESOLVED = object()


class CpuPlatform(Platform):
    """The host CPU: always usable; one device; gloo for tensor parallelism."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    supported_dtypes = (torch.bfloat16, torch.float32, torch.float16)

    #: resolved on the first call of layer_kernels() (subclasses need not call __init__)
    _layer_kernels: object = _UNRESOLVED

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def detection_detail(cls) -> str:
        return f"always available ({os.cpu_count()} cores, bf16 native: {has_fast_bf16()})"

    def device_count(self) -> int:
        return 1

    def tensor_parallel_devices(self, size: int) -> list[int]:
        """Every rank runs on the host, with its share of the cores (at least one each)."""
        cores = len(os.sched_getaffinity(0))
        if size > cores:
            raise ValueError(
                f"--tensor-parallel-size {size} needs a core per rank; this host has {cores}"
            )
        return [0] * size

    def data_parallel_devices(
        self, engine_index: int, num_engines: int, tensor_parallel_size: int
    ) -> list[int]:
        """Every engine's ranks run on the host: at least one core per rank of every engine
        (each engine core then keeps its share of the cores, ``core/data_parallel.py``)."""
        cores = len(os.sched_getaffinity(0))
        needed = num_engines * tensor_parallel_size
        if needed > cores:
            raise ValueError(
                f"--data-parallel-size {num_engines} with --tensor-parallel-size "
                f"{tensor_parallel_size} needs a core per rank ({needed}); this host has {cores}"
            )
        return [0] * tensor_parallel_size

    def ray_resources(self) -> dict[str, float]:
        """A core per rank, as :meth:`tensor_parallel_devices` asks of one host."""
        return {"CPU": 1.0}

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cpu")

    def device_name(self, index: int = 0) -> str:
        for line in _read_lines("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
        return "cpu"

    def memory_total(self, index: int = 0) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def memory_available(self, index: int = 0) -> int:
        for line in _read_lines("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
        return self.memory_total(index) // 2

    def init_worker_process(self) -> None:
        keep_heap_allocations()

    def determine_kv_cache_memory(self, config: EngineConfig, profile: Callable[[], None]) -> int:
        """``--kv-cache-memory``, else 4 GiB or 30% of available memory, whichever is less;
        with tensor or data parallelism, that budget split over every rank of every engine
        (all on this host).

        Host memory is shared with everything else on the machine, so the CPU never claims a
        fraction of the total the way a GPU does.
        """
        if config.kv_cache_memory is not None:
            budget = config.kv_cache_memory
        else:
            budget = min(DEFAULT_CPU_KV_CACHE_BYTES, int(self.memory_available() * 0.3))
        # All ranks of all engines share this host's memory: the budget is theirs together.
        return budget // (config.tensor_parallel_size * config.data_parallel_size)

    def kv_cache_zeros(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Zeros the kernel fills page by page as the cache is written
        (``platforms/cpu_lazy_zeros``): ``torch.zeros`` of the default 4 GiB cache took
        2-18 s of every engine start, depending on the machine's load (docs/development.md,
        "Engine start-up")."""
        from chassis.platforms.cpu_lazy_zeros import lazy_zeros

        return lazy_zeros(shape, dtype)

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if has_fast_bf16() else torch.float32

    def default_attention_backend(self, config: EngineConfig) -> str:
        """``cpu_paged``, or ``torch_paged`` for a KV-cache dtype ``cpu_paged``'s compiled
        kernels do not read (``--kv-cache-dtype fp8``): asked of the backends, not assumed."""
        return self.first_backend_for(config, ("cpu_paged", "torch_paged"))

    def host_reads_are_free(self) -> bool:
        return True

    def layer_kernels(self) -> LayerKernels | None:
        """The compiled C++ kernels of ``platforms/cpu_kernels`` (built on first call, cached).

        ``None`` when ``CHASSIS_CPU_KERNELS=0`` or no compiler/build is available; layers then
        run their torch code.
        """
        if self._layer_kernels is _UNRESOLVED:
            from chassis.platforms import cpu_kernels
            from chassis.platforms.cpu_kernels.layer_kernels import CpuLayerKernels

            ops = cpu_kernels.load()
            self._layer_kernels = None if ops is None else CpuLayerKernels(ops)
        return self._layer_kernels  # type: ignore[return-value]

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Pack bfloat16 linear weights once for a fast kernel (``platforms/cpu_packed_linear``):
        the compiled ``chassis_cpu::linear`` where the CPU and shapes allow, else oneDNN's; then
        back the packed weights with 2 MB pages (``platforms/cpu_huge_pages``).

        Same values as ``F.linear`` up to rare one-step bf16 roundings; measured batch-1 decode
        steps: ~25 % faster with oneDNN's packing, ~28 % faster again with the chassis kernel;
        the linear layers of a batch-1 step ~17 % faster again on huge pages.
        """
        from chassis.platforms.cpu_packed_linear import pack_linear_weights, packed_linear_layers

        count = pack_linear_weights(model)
        if count:
            packed = packed_linear_layers(model)
            kernels = Counter(m.kernel for m in packed)
            logger.info(
                "packed %d bf16 linear weights (%s)",
                count,
                ", ".join(f"{n} for {name}" for name, n in sorted(kernels.items())),
            )
            _back_with_huge_pages(packed)

    # -- sleep mode -------------------------------------------------------------------------

    def device_memory_is_host_memory(self) -> bool:
        return True

    def empty_cache(self) -> None:
        """``malloc_trim(0)``: glibc returns the free pages of its heaps to the system. The
        engine keeps freed buffers up to 1 GiB in the heap (:func:`keep_heap_allocations`),
        so without this the weights sleep mode frees would stay in the process's RSS."""
        release_free_heap_memory()

    def release_prepared_weights(self, model: torch.nn.Module) -> None:
        """Drop the packed copies of the bf16 linear weights (``prepare_model``)."""
        from chassis.platforms.cpu_packed_linear import packed_linear_layers

        for layer in packed_linear_layers(model):
            layer.release()

    def restore_prepared_weights(self, model: torch.nn.Module) -> None:
        """Pack the linear weights again (back on huge pages), as ``prepare_model`` did."""
        from chassis.platforms.cpu_packed_linear import packed_linear_layers

        packed = packed_linear_layers(model)
        for layer in packed:
            layer.repack()
        _back_with_huge_pages(packed)


def _back_with_huge_pages(packed: list[PackedLinear]) -> None:
    """Collapse the packed weights' pages into huge pages (``platforms/cpu_huge_pages``)."""
    from chassis.platforms.cpu_huge_pages import collapse_into_huge_pages

    start = time.perf_counter()
    # (oneDNN's packed weights are opaque tensors, which the function skips)
    collapsed = collapse_into_huge_pages(m.packed_weight for m in packed)
    if collapsed:
        logger.info(
            "packed weights on huge pages: %.0f MiB in %.2f s",
            collapsed / 2**20,
            time.perf_counter() - start,
        )


def release_free_heap_memory() -> bool:
    """Return the C heap's free pages to the system (glibc ``malloc_trim(0)``); whether
    glibc released any (``False`` elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


#: mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: allocations up to this size come from the heap and freed memory stays in the process
_HEAP_KEEP_BYTES = 1 << 30


def keep_heap_allocations() -> bool:
    """Make glibc keep freed activation buffers instead of unmapping them.

    By default glibc serves large allocations with ``mmap`` and trims freed heap memory, so a
    CPU forward pass page-faults its multi-MB activations in afresh on every op; measured here,
    that made a 2048-token prefill step of SmolLM2 about 30% slower. Returns whether glibc
    accepted the settings (elsewhere this is a no-op).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(
            libc.mallopt(_M_MMAP_THRESHOLD, _HEAP_KEEP_BYTES)
            and libc.mallopt(_M_TRIM_THRESHOLD, _HEAP_KEEP_BYTES)
        )
    except (OSError, AttributeError):
        return False


def _read_lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.readlines()
    except OSError:
        return []


@hookimpl
def chassis_platform() -> type[Platform] | None:
    return CpuPlatform
