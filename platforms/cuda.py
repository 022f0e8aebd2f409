"""The CUDA platform (NVIDIA GPUs through torch.cuda on a non-HIP build)."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import torch

from chassis.platforms import torch_facts
from chassis.platforms.interface import Platform
from chassis.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from chassis.core.config import EngineConfig
    from chassis.core.layers.kernels import LayerKernels

logger = logging.getLogger(__name__)

#: ``CHASSIS_TRITON_GEMV=1``: few-row linear layers run the Triton GEMV (opt-in, unmeasured)
TRITON_GEMV_VARIABLE = "CHASSIS_TRITON_GEMV"


@cache
def _triton_layer_kernels() -> LayerKernels | None:
    if importlib.util.find_spec("triton") is None:
        return None
    from chassis.core.layers.triton_ops import TritonLayerKernels

    return TritonLayerKernels()


@dataclass(frozen=True)
class _CudaGraphPool:
    """What :meth:`TorchCudaLikePlatform.new_graph_pool` hands out (opaque to core code)."""

    #: from ``torch.cuda.graph_pool_handle()``: graphs captured with it share one memory pool
    handle: Any
    #: the side stream every graph of the pool is warmed up and captured on
    stream: torch.cuda.Stream


class TorchCudaLikePlatform(Platform):
    """Shared by CUDA and ROCm: both drive devices through the ``torch.cuda`` API."""

    device_type = "cuda"
    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    # (kernels queue on a stream; --async-scheduling measured faster on an H200:
    # docs/scheduling.md)
    device_runs_async = True

    def device_count(self) -> int:
        return torch_facts.cuda_device_count()

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def device_name(self, index: int = 0) -> str:
        return torch.cuda.get_device_name(index)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: the caching allocator's free blocks go back to the
        device (sleep mode)."""
        torch.cuda.empty_cache()

    def memory_total(self, index: int = 0) -> int:
        return torch.cuda.mem_get_info(index)[1]

    def _fp8_kv_formats(self, has_e4m3: Callable[[int], bool]) -> tuple[torch.dtype, ...]:
        """Both 8-bit formats when ``has_e4m3(i)`` for every visible device ``i`` (and there
        is one), else e5m2 alone: Triton converts e5m2 on every GPU of both vendors."""
        devices = range(self.device_count())
        if devices and all(has_e4m3(i) for i in devices):
            return (torch.float8_e4m3fn, torch.float8_e5m2)
        return (torch.float8_e5m2,)

    def memory_available(self, index: int = 0) -> int:
        return torch.cuda.mem_get_info(index)[0]

    def determine_kv_cache_memory(self, config: EngineConfig, profile: Callable[[], None]) -> int:
        """Profile a forward at the max token budget, then grant
        ``gpu_memory_utilization * total`` minus the torch peak and non-torch usage."""
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        profile()
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        peak = torch.cuda.max_memory_allocated()
        non_torch = total - free - torch.cuda.memory_reserved()
        return int(total * config.gpu_memory_utilization) - peak - max(non_torch, 0)

    def default_attention_backend(self, config: EngineConfig) -> str:
        return "triton_paged"

    def layer_kernels(self) -> LayerKernels | None:
        """The Triton RMSNorm(+residual), SiLU-and-mul and RoPE kernels (``core/layers/
        triton_ops``), when Triton is installed; the layers' torch code otherwise."""
        return _triton_layer_kernels()

    def prepare_model(self, model: torch.nn.Module) -> None:
        """With ``CHASSIS_TRITON_GEMV=1`` (default off) and Triton installed: every plain
        ``nn.Linear`` becomes a :class:`~chassis.platforms.cuda_small_batch_linear.
        SmallBatchLinear` sharing its parameters, which runs inputs of up to 8 rows (batch-1
        to batch-8 decode) through the Triton GEMV of ``core/layers/triton_gemv`` and the
        rest through ``F.linear`` (docs/gpu.md, "Small-batch GEMV"). Off by default until an
        H200 run shows it beats cuBLAS. LoRA's wrappers exist by now (the worker builds them
        first); the plain ``nn.Linear`` inside each is swapped, the wrapper stays. Otherwise
        nothing: the weights stay as loaded."""
        if os.environ.get(TRITON_GEMV_VARIABLE) != "1":
            return
        if importlib.util.find_spec("triton") is None:
            logger.warning("%s=1 ignored: Triton is not installed", TRITON_GEMV_VARIABLE)
            return
        from chassis.platforms.cuda_small_batch_linear import use_small_batch_gemv

        count = use_small_batch_gemv(model)
        logger.info(
            "%s=1: %d linear layers run inputs of up to 8 rows through the Triton GEMV",
            TRITON_GEMV_VARIABLE,
            count,
        )

    def supports_graph_capture(self) -> bool:
        return True

    def new_graph_pool(self) -> object:
        """A ``torch.cuda`` graph memory pool and the side stream its graphs are captured on."""
        return _CudaGraphPool(torch.cuda.graph_pool_handle(), torch.cuda.Stream())

    def capture_graph(
        self, fn: Callable[[], torch.Tensor], pool: object, num_warmup: int = 2
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up, then capture ``fn`` into a ``torch.cuda.CUDAGraph`` on the pool's stream.

        See :meth:`Platform.capture_graph`. Capture cannot happen on the default stream, so
        it runs on the pool's side stream; the warm-up calls run on that same stream, because
        libraries such as cuBLAS set up per-stream state on first use, which must not happen
        inside the capture. Triton kernels compile during the warm-up as well.
        """
        if not isinstance(pool, _CudaGraphPool):
            raise ValueError(f"pool must come from {type(self).__name__}.new_graph_pool()")
        stream = pool.stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(num_warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool.handle, stream=stream):
            output = fn()
        torch.cuda.synchronize()
        return graph, output

    def pin_memory_available(self) -> bool:
        return True

    def record_event(self) -> torch.cuda.Event:
        """A ``torch.cuda.Event`` recorded on the current stream (waits for that work only)."""
        event = torch.cuda.Event()
        event.record()
        return event


class CudaPlatform(TorchCudaLikePlatform):
    """NVIDIA GPUs: usable when torch is a CUDA build (not HIP) and sees at least one device."""

    name = "cuda"
    dist_backend = "nccl"

    def fp8_kv_cache_dtypes(self) -> tuple[torch.dtype, ...]:
        """e5m2 on every GPU; e4m3 only when every visible device is sm_89 or later (Ada,
        Hopper, Blackwell): Triton's ``fp8e4nv`` type, which the ``triton_paged`` kernels
        convert to and from, does not exist below compute capability 8.9, whereas ``fp8e5``
        converts in software there."""
        return self._fp8_kv_formats(lambda i: torch_facts.cuda_capability(i) >= (8, 9))

    @classmethod
    def is_available(cls) -> bool:
        return torch_facts.hip_version() is None and torch_facts.cuda_device_count() > 0

    @classmethod
    def detection_detail(cls) -> str:
        if torch_facts.hip_version() is not None:
            return "torch is a HIP (ROCm) build: see the rocm platform"
        version = torch_facts.cuda_version()
        if version is None:
            return "torch is built without CUDA"
        return f"torch CUDA {version}, {torch_facts.cuda_device_count()} device(s) visible"


@hookimpl
def chassis_platform() -> type[Platform] | None:
    return CudaPlatform if CudaPlatform.is_available() else None
