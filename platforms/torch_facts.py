"""The torch facts platform detectors read, as small functions tests can replace."""

from __future__ import annotations

import importlib.util

import torch


def hip_version() -> str | None:
    """torch's HIP version on a ROCm build, else None."""
    return getattr(torch.version, "hip", None)


def cuda_version() -> str | None:
    """torch's CUDA version on a CUDA build, else None (CPU-only and HIP builds)."""
    return getattr(torch.version, "cuda", None)


def cuda_device_count() -> int:
    """Devices torch.cuda sees (CUDA or HIP); 0 when the runtime is unusable."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver reads as "no device", and detection_detail says so
        return 0


def cuda_capability(index: int) -> tuple[int, int]:
    """The compute capability of CUDA device ``index`` (``(8, 9)`` for sm_89); initializes
    CUDA in this process."""
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


def rocm_arch(index: int) -> str:
    """The GCN architecture of ROCm device ``index`` without its feature flags
    (``"gfx942"`` of ``"gfx942:sramecc+:xnack-"``); initializes HIP in this process."""
    return str(torch.cuda.get_device_properties(index).gcnArchName).split(":")[0]


def xpu_built() -> bool:
    """Whether this torch build was compiled with XPU (Intel GPU) support."""
    xpu = getattr(torch, "xpu", None)
    try:
        return bool(xpu is not None and xpu._is_compiled())
    except Exception:
        return False


def xpu_device_count() -> int:
    """Devices torch.xpu sees; 0 without XPU support or devices."""
    xpu = getattr(torch, "xpu", None)
    try:
        return xpu.device_count() if xpu is not None and xpu.is_available() else 0
    except Exception:
        return 0


def module_present(name: str) -> bool:
    """Whether module ``name`` can be imported (found without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def libtpu_present() -> bool:
    """Whether the TPU runtime library (``libtpu`` or ``libtpu_nightly``) is installed."""
    return module_present("libtpu") or module_present("libtpu_nightly")


def tpu_device_count() -> int:
    """TPU devices seen through torch_xla (0 without torch_xla, libtpu or devices)."""
    if not module_present("torch_xla") or not libtpu_present():
        return 0
    try:
        import torch_xla.runtime as xr  # type: ignore[import-not-found]

        return int(xr.global_runtime_device_count()) if xr.device_type() == "TPU" else 0
    except Exception:
        return 0
