"""The ``Platform`` interface: what core code asks of the hardware it runs on.

Core code never branches on a device name; it asks ``current_platform``. A vendor plugin
subclasses :class:`Platform` and returns the subclass from its ``chassis_platform`` hook.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

if TYPE_CHECKING:
    from chassis.core.config import EngineConfig
    from chassis.core.layers.kernels import LayerKernels


class DeviceGraph(Protocol):
    """A captured sequence of device work (e.g. ``torch.cuda.CUDAGraph``), replayable."""

    def replay(self) -> None:
        """Re-run the captured work on the current contents of the tensors it captured."""


class DeviceEvent(Protocol):
    """A point in the device's queue of work (e.g. ``torch.cuda.Event``), already recorded."""

    def synchronize(self) -> None:
        """Block the host until all work queued before the event has finished."""

    def query(self) -> bool:
        """Whether all work queued before the event has finished; never blocks. (Optional:
        callers treat an event without it as unfinished and call :meth:`synchronize`.)"""
        ...


class _QueueDrainEvent:
    """The default :class:`DeviceEvent`: waits for *all* queued work of the platform.

    Correct on every platform, but it also waits for work queued after the event, which
    removes any overlap the caller hoped for; platforms with real events override
    :meth:`Platform.record_event`.
    """

    def __init__(self, platform: Platform) -> None:
        self._platform = platform

    def synchronize(self) -> None:
        self._platform.synchronize()

    def query(self) -> bool:
        return False  # (it cannot tell without waiting)


class Platform(ABC):
    """One kind of device. Instantiated once per process as ``current_platform``.

    Class attributes are the identity; methods answer capability and resource questions.
    """

    #: Short name, used by ``CHASSIS_PLATFORM`` and shown by ``chassis env`` (``"cuda"``).
    name: ClassVar[str]
    #: The ``torch.device`` type tensors go to (``"cuda"``, ``"cpu"``, ``"xpu"``, ``"xla"``).
    device_type: ClassVar[str]
    #: The ``torch.distributed`` backend for tensor parallelism (``"nccl"``, ``"gloo"``).
    dist_backend: ClassVar[str]
    #: dtypes a model may run in on this device, best first.
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)
    #: Whether kernels launched on this device run asynchronously to the host (a CUDA
    #: stream), so that planning step N+1 while step N runs overlaps host and device work:
    #: the default of ``--async-scheduling`` (``core/async_scheduling_default.py``).
    device_runs_async: ClassVar[bool] = False

    #: Why this platform was chosen; filled in by platform resolution.
    selection_reason: str = ""

    # -- detection ----------------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Whether the device is present and usable in this process. Cheap; no side effects."""

    @classmethod
    def detection_detail(cls) -> str:
        """A one-line account of what detection saw (for ``chassis env``)."""
        return "available" if cls.is_available() else "not available"

    # -- devices ------------------------------------------------------------------------------

    @abstractmethod
    def device_count(self) -> int:
        """Number of devices of this kind visible to the process."""

    def device(self, index: int = 0) -> torch.device:
        """The ``torch.device`` for local device ``index``."""
        return torch.device(self.device_type, index)

    def set_device(self, index: int) -> None:  # noqa: B027 (optional; no-op default)
        """Make ``index`` the current device of this process (default: nothing to do)."""

    def tensor_parallel_devices(self, size: int) -> list[int]:
        """The local device index of each rank of a tensor-parallel group of ``size``
        processes (rank ``r`` uses entry ``r``). Default: one device per rank, so ``size``
        must not exceed :meth:`device_count` (a ``ValueError`` naming both)."""
        count = self.device_count()
        if size > count:
            raise ValueError(
                f"--tensor-parallel-size {size} needs {size} {self.name} devices; {count} visible"
            )
        return list(range(size))

    def data_parallel_devices(
        self, engine_index: int, num_engines: int, tensor_parallel_size: int
    ) -> list[int]:
        """The local device index of each tensor-parallel rank of engine ``engine_index`` of
        ``num_engines`` data-parallel engines on this host (rank ``r`` uses entry ``r``).
        Called in the front-end (to check, before any engine starts) and in each engine.
        Default: one device per rank, engine ``i`` on devices ``i*T .. (i+1)*T - 1`` for
        ``T = tensor_parallel_size``, so ``num_engines * T`` must not exceed
        :meth:`device_count` (a ``ValueError`` naming all three)."""
        count = self.device_count()
        needed = num_engines * tensor_parallel_size
        if needed > count:
            raise ValueError(
                f"--data-parallel-size {num_engines} with --tensor-parallel-size "
                f"{tensor_parallel_size} needs {needed} {self.name} devices (one per rank); "
                f"{count} visible"
            )
        first = engine_index * tensor_parallel_size
        return list(range(first, first + tensor_parallel_size))

    def ray_resources(self) -> dict[str, float]:
        """The Ray resources one rank reserves (one placement-group bundle) under
        ``--distributed-executor-backend ray``; Ray then makes only that device visible to the
        rank's actor. Default: one ``GPU`` (Ray's name for CUDA, ROCm and Intel GPUs)."""
        return {"GPU": 1.0}

    def synchronize(self) -> None:  # noqa: B027 (optional; no-op default)
        """Wait for all queued work on the current device (default: nothing queued)."""

    def device_name(self, index: int = 0) -> str:
        """Human-readable name of device ``index``."""
        return self.name

    def init_worker_process(self) -> None:  # noqa: B027 - optional hook
        """Tune the process that will run the model, once, before the model loads.

        Default: nothing. The CPU platform uses it to stop the C allocator from returning
        large activation buffers to the OS after every op (page faults on each step).
        """

    # -- memory -------------------------------------------------------------------------------

    @abstractmethod
    def memory_total(self, index: int = 0) -> int:
        """Total memory of device ``index`` in bytes."""

    @abstractmethod
    def memory_available(self, index: int = 0) -> int:
        """Memory of device ``index`` free for this process now, in bytes."""

    def determine_kv_cache_memory(self, config: EngineConfig, profile: Callable[[], None]) -> int:
        """Bytes to give the KV cache, after the model is loaded.

        ``config.kv_cache_memory`` wins when set. Otherwise this default runs ``profile`` (one
        forward at the maximum token budget, so activation peaks are in use) and grants
        ``gpu_memory_utilization`` of the device minus what is in use. Platforms with better
        memory statistics override it.
        """
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory
        profile()
        self.synchronize()
        in_use = self.memory_total() - self.memory_available()
        return int(self.memory_total() * config.gpu_memory_utilization) - in_use

    # -- capabilities -------------------------------------------------------------------------

    def default_dtype(self) -> torch.dtype:
        """The dtype ``--dtype auto`` resolves to for a checkpoint stored in 16-bit floats."""
        return self.supported_dtypes[0]

    @abstractmethod
    def default_attention_backend(self, config: EngineConfig) -> str:
        """Name (in the attention-backend registry) of the backend to use without a flag."""

    @staticmethod
    def first_backend_for(config: EngineConfig, candidates: tuple[str, ...]) -> str:
        """The first of ``candidates`` (attention-backend names, best first) whose class
        supports ``config.kv_cache_dtype`` (its ``supported_kv_cache_dtypes``); the first
        candidate when none does (the config check then names the backends that do)."""
        if config.kv_cache_dtype == "auto":
            return candidates[0]
        from chassis.core.attention import resolve_kv_cache_dtype
        from chassis.plugins import get_registries

        dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, torch.float32)
        registry = get_registries().attention_backends
        for name in candidates:
            if dtype in registry.get(name).supported_kv_cache_dtypes:
                return name
        return candidates[0]

    def fp8_kv_cache_dtypes(self) -> tuple[torch.dtype, ...]:
        """The 8-bit KV cache formats (``torch.float8_e4m3fn``, ``torch.float8_e5m2``) this
        platform's devices can store and read with device-dependent kernels (an attention
        backend with ``fp8_kv_cache_needs_device_support``, such as ``triton_paged``):
        ``--kv-cache-dtype`` values of other formats are refused at engine setup
        (:meth:`check_and_update_config`), before any kernel compiles; a backend converting
        with torch code (``torch_paged``) stores both anywhere. Default: both, which
        torch code converts on any device; a platform whose kernels depend on the hardware
        (Triton's fp8 conversions on GPUs) answers from the devices it sees."""
        from chassis.core.attention import FP8_KV_DTYPES

        return FP8_KV_DTYPES

    def supports_graph_capture(self) -> bool:
        """Whether decode steps can be captured and replayed as device graphs.

        When ``True``, :meth:`new_graph_pool` and :meth:`capture_graph` must work.
        """
        return False

    def new_graph_pool(self) -> object:
        """A memory pool that several graphs captured with it share (an opaque handle).

        Graphs of one pool must never replay concurrently: each may reuse the intermediate
        memory of the others. Default: graph capture is not supported (``NotImplementedError``).
        """
        raise NotImplementedError(
            f"platform {self.name!r} cannot capture graphs (supports_graph_capture() is False)"
        )

    def capture_graph(
        self, fn: Callable[[], torch.Tensor], pool: object, num_warmup: int = 2
    ) -> tuple[DeviceGraph, torch.Tensor]:
        """Run ``fn`` ``num_warmup`` times eagerly, then capture one call of it as a graph.

        ``fn`` takes no arguments and must read and write only tensors that outlive the graph
        (static buffers); it must not read device values on the host. The warm-up calls
        compile kernels and initialize libraries, so that nothing of that happens while
        capturing. Returns the graph and the tensor ``fn`` returned during capture: each
        :meth:`DeviceGraph.replay` recomputes it in place from the static buffers' current
        contents. ``pool`` comes from :meth:`new_graph_pool`. Default: not supported
        (``NotImplementedError``).
        """
        raise NotImplementedError(
            f"platform {self.name!r} cannot capture graphs (supports_graph_capture() is False)"
        )

    def prepare_model(self, model: torch.nn.Module) -> None:  # noqa: B027 - optional hook
        """Adapt a loaded model to this device in place before it runs (e.g. repack weights).

        Called by the worker once the weights are loaded. Must not change the model's results
        beyond rounding-identical reformulations; the default does nothing.
        """

    # -- sleep mode (docs/serving.md, "Sleep mode") -------------------------------------------

    def device_memory_is_host_memory(self) -> bool:
        """Whether this platform's device memory *is* the host's memory (the CPU).

        Sleep mode's level 1 moves the weights to host memory; where they are there already
        it leaves them in place (the KV cache is still freed). Default ``False``.
        """
        return False

    def empty_cache(self) -> None:  # noqa: B027 (optional; no-op default)
        """Give the memory freed tensors left in this process's allocator back to the
        device (or the operating system), now.

        Called after sleep mode freed weights or the KV cache and after it brought them
        back, so that the memory is really free for others (``torch.cuda.empty_cache()`` on
        CUDA, ``malloc_trim`` for the host's C allocator on the CPU). Must not free memory
        a live tensor uses. Default: nothing (an allocator that caches nothing).
        """

    def release_prepared_weights(self, model: torch.nn.Module) -> None:  # noqa: B027
        """Drop every copy of ``model``'s weights that :meth:`prepare_model` made (packed
        layouts, ...), because sleep mode is about to free or move the weights themselves;
        the copies would otherwise keep their memory. The model is not run until
        :meth:`restore_prepared_weights`. Default: nothing (``prepare_model`` made none).
        """

    def restore_prepared_weights(self, model: torch.nn.Module) -> None:  # noqa: B027
        """Rebuild what :meth:`release_prepared_weights` dropped, from ``model``'s weights as
        they are now (back on the device, possibly reloaded from the checkpoint); the model
        then runs exactly as after :meth:`prepare_model`. Default: nothing.
        """

    def layer_kernels(self) -> LayerKernels | None:
        """Fused implementations of the decoder-layer ops for this platform's tensors.

        Layers (RMSNorm, SiLU-and-mul, rotary embedding) call these instead of their torch
        reference when the returned object ``handles`` the tensor; ``None`` (the default)
        means the torch references everywhere. Contract in
        :class:`chassis.core.layers.kernels.LayerKernels`.
        """
        return None

    def kv_cache_zeros(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A zero-filled, contiguous KV cache tensor of ``shape`` and ``dtype`` on ``device``.

        Called once per cache tensor when the engine starts. The default is ``torch.zeros``;
        a platform whose zero fill writes every page by hand (host memory) may return memory
        that reads as zeros without writing it first.
        """
        return torch.zeros(shape, dtype=dtype, device=device)

    def pin_memory_available(self) -> bool:
        """Whether host staging buffers should be pinned for non-blocking copies."""
        return False

    def record_event(self) -> DeviceEvent:
        """Record an event after the work queued so far on the current stream.

        Async scheduling copies a step's sampled ids to the host without waiting, queues the
        next step, and only then calls the event's ``synchronize()``. Default: an event whose
        ``synchronize()`` is :meth:`synchronize` (correct, but it waits for the later step
        too); override with the device's own events.
        """
        return _QueueDrainEvent(self)

    def host_reads_are_free(self) -> bool:
        """Whether reading a device tensor's values on the host (``bool(t)``, ``.item()``)
        costs no device synchronization, because the device is the host.

        Code that otherwise avoids host reads (the sampler) may then look at values before
        choosing how much work to do. Default ``False``.
        """
        return False

    def check_and_update_config(self, config: EngineConfig) -> None:
        """Validate ``config`` for this device and fill device-dependent fields in place.

        Raise ``ValueError`` with an actionable message for what this device cannot do. The
        default checks that the attention backend stores ``--kv-cache-dtype`` and, for a
        backend whose 8-bit conversions depend on the device
        (``fp8_kv_cache_needs_device_support``, as Triton's do), that the device does
        (:meth:`fp8_kv_cache_dtypes`); an override should call it.
        """
        if config.attention_backend is not None and config.kv_cache_dtype != "auto":
            from chassis.core.attention import check_kv_cache_dtype
            from chassis.plugins import get_registries

            backend = get_registries().attention_backends.get(config.attention_backend)
            if backend.fp8_kv_cache_needs_device_support:
                self._check_fp8_kv_cache(config.kv_cache_dtype)
            check_kv_cache_dtype(config.attention_backend, backend, config.kv_cache_dtype)

    def _check_fp8_kv_cache(self, kv_cache_dtype: str) -> None:
        from chassis.core.attention import FP8_KV_CACHE_DTYPES, resolve_kv_cache_dtype

        dtype = resolve_kv_cache_dtype(kv_cache_dtype, torch.float32)
        supported = self.fp8_kv_cache_dtypes()
        if dtype in supported:
            return
        choices = ["auto"] + [n for n, d in FP8_KV_CACHE_DTYPES.items() if d in supported]
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype} ({str(dtype).removeprefix('torch.')}) is not "
            f"supported on this {self.name} device ({self.device_name(0)}); choices here: "
            f"{', '.join(choices)} (docs/performance.md, 'FP8 KV cache')"
        )

    # -- reporting ----------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """Facts for ``chassis env``."""
        count = self.device_count()
        return {
            "platform": self.name,
            "device_type": self.device_type,
            "dist_backend": self.dist_backend,
            "device_count": count,
            "devices": [self.device_name(i) for i in range(count)],
            "supported_dtypes": [str(d).removeprefix("torch.") for d in self.supported_dtypes],
            "graph_capture": self.supports_graph_capture(),
            "selected_because": self.selection_reason,
        }

    def __repr__(self) -> str:
        return f"<Platform {self.name}>"
