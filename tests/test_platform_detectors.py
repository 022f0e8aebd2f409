"""The built-in platform detectors, driven by monkeypatched ``torch_facts``.

Only the CPU has run on real hardware here; the other detectors are checked against the torch
facts they read, so each answers correctly whatever machine runs the tests.
"""

from __future__ import annotations

import pytest
import torch

from chassis.platforms import cpu, cuda, rocm, tpu, xpu
from chassis.platforms import torch_facts as facts
from chassis.platforms.cpu import CpuPlatform
from chassis.platforms.cuda import CudaPlatform
from chassis.platforms.rocm import RocmPlatform
from chassis.platforms.tpu import TpuPlatform
from chassis.platforms.xpu import XpuPlatform


def set_facts(monkeypatch: pytest.MonkeyPatch, **values: object) -> None:
    """Replace ``torch_facts.<name>`` by a function returning ``value``."""
    for name, value in values.items():
        monkeypatch.setattr(facts, name, lambda value=value: value)


# -- CUDA -----------------------------------------------------------------------------------


def _capabilities(monkeypatch: pytest.MonkeyPatch, fact: str, values: list) -> None:
    monkeypatch.setattr(facts, "cuda_device_count", lambda: len(values))
    monkeypatch.setattr(facts, fact, lambda index: values[index])


@pytest.mark.parametrize(
    ("capabilities", "formats"),
    [
        ([(9, 0)], (torch.float8_e4m3fn, torch.float8_e5m2)),  # H100/H200
        ([(8, 9), (12, 0)], (torch.float8_e4m3fn, torch.float8_e5m2)),  # L4, Blackwell
        ([(8, 0)], (torch.float8_e5m2,)),  # A100: no e4m3 in Triton below sm_89
        ([(9, 0), (8, 6)], (torch.float8_e5m2,)),  # every visible device must have it
        ([(7, 5)], (torch.float8_e5m2,)),
    ],
)
def test_cuda_fp8_kv_formats_follow_the_compute_capability(
    monkeypatch: pytest.MonkeyPatch, capabilities: list, formats: tuple
) -> None:
    _capabilities(monkeypatch, "cuda_capability", capabilities)
    assert CudaPlatform().fp8_kv_cache_dtypes() == formats


def test_an_fp8_kv_format_the_gpu_lacks_is_refused_naming_device_and_choices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from chassis.core.config import EngineConfig

    _capabilities(monkeypatch, "cuda_capability", [(8, 0)])
    monkeypatch.setattr(CudaPlatform, "device_name", lambda self, index=0: "NVIDIA A100")
    platform = CudaPlatform()
    for flag in ("fp8", "fp8_e4m3"):
        config = EngineConfig(kv_cache_dtype=flag, attention_backend="triton_paged")
        with pytest.raises(ValueError) as refused:
            platform.check_and_update_config(config)
        assert f"--kv-cache-dtype {flag} (float8_e4m3fn)" in str(refused.value)
        assert "cuda device (NVIDIA A100)" in str(refused.value)
        assert "choices here: auto, fp8_e5m2" in str(refused.value)
    platform.check_and_update_config(
        EngineConfig(kv_cache_dtype="fp8_e5m2", attention_backend="triton_paged")
    )
    platform.check_and_update_config(EngineConfig(attention_backend="triton_paged"))  # auto
    # torch_paged converts with torch code, on any GPU: e4m3 is not the device's business
    platform.check_and_update_config(
        EngineConfig(kv_cache_dtype="fp8", attention_backend="torch_paged")
    )


@pytest.mark.parametrize(
    ("archs", "formats"),
    [
        (["gfx942"], (torch.float8_e4m3fn, torch.float8_e5m2)),  # MI300
        (["gfx950"], (torch.float8_e4m3fn, torch.float8_e5m2)),  # MI350
        (["gfx90a"], (torch.float8_e5m2,)),  # MI200: Triton gives it fp8e5 only
        (["gfx1100"], (torch.float8_e5m2,)),
        (["gfx942", "gfx90a"], (torch.float8_e5m2,)),
    ],
)
def test_rocm_fp8_kv_formats_follow_the_architecture(
    monkeypatch: pytest.MonkeyPatch, archs: list, formats: tuple
) -> None:
    _capabilities(monkeypatch, "rocm_arch", archs)
    assert RocmPlatform().fp8_kv_cache_dtypes() == formats


def test_platforms_without_device_kernels_store_both_fp8_formats() -> None:
    assert CpuPlatform().fp8_kv_cache_dtypes() == (torch.float8_e4m3fn, torch.float8_e5m2)


def test_cuda_needs_a_cuda_build_with_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    set_facts(monkeypatch, hip_version=None, cuda_version="12.8", cuda_device_count=2)
    assert CudaPlatform.is_available()
    assert cuda.chassis_platform() is CudaPlatform
    assert CudaPlatform.detection_detail() == "torch CUDA 12.8, 2 device(s) visible"
    assert CudaPlatform().device_count() == 2

    set_facts(monkeypatch, cuda_device_count=0)
    assert not CudaPlatform.is_available()
    assert cuda.chassis_platform() is None
    assert "0 device(s)" in CudaPlatform.detection_detail()


def test_cuda_is_not_chosen_on_a_cpu_only_build(monkeypatch: pytest.MonkeyPatch) -> None:
    set_facts(monkeypatch, hip_version=None, cuda_version=None, cuda_device_count=0)
    assert not CudaPlatform.is_available()
    assert CudaPlatform.detection_detail() == "torch is built without CUDA"


def test_cuda_steps_aside_on_a_hip_build(monkeypatch: pytest.MonkeyPatch) -> None:
    set_facts(monkeypatch, hip_version="6.2", cuda_version=None, cuda_device_count=1)
    assert not CudaPlatform.is_available()
    assert "HIP" in CudaPlatform.detection_detail()


def test_cuda_platform_identity() -> None:
    assert (CudaPlatform.name, CudaPlatform.device_type, CudaPlatform.dist_backend) == (
        "cuda",
        "cuda",
        "nccl",
    )
    platform = CudaPlatform()
    assert platform.supports_graph_capture()
    assert platform.pin_memory_available()
    assert platform.device(1) == torch.device("cuda", 1)


# -- ROCm -----------------------------------------------------------------------------------


def test_rocm_needs_a_hip_build_with_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    set_facts(monkeypatch, hip_version="6.2.4", cuda_device_count=1)
    assert RocmPlatform.is_available()
    assert rocm.chassis_platform() is RocmPlatform
    assert RocmPlatform.detection_detail() == "torch HIP 6.2.4, 1 device(s) visible"
    # ROCm drives its GPUs through torch.cuda
    assert RocmPlatform.device_type == "cuda" and RocmPlatform.name == "rocm"

    set_facts(monkeypatch, cuda_device_count=0)
    assert not RocmPlatform.is_available()
    assert rocm.chassis_platform() is None


def test_rocm_is_not_chosen_on_a_non_hip_build(monkeypatch: pytest.MonkeyPatch) -> None:
    set_facts(monkeypatch, hip_version=None, cuda_device_count=4)
    assert not RocmPlatform.is_available()
    assert RocmPlatform.detection_detail() == "torch is not a HIP build"


# -- XPU ------------------------------------------------------------------------------------


def test_xpu_needs_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    set_facts(monkeypatch, xpu_built=True, xpu_device_count=2)
    assert XpuPlatform.is_available()
    assert xpu.chassis_platform() is XpuPlatform
    assert XpuPlatform.detection_detail() == "torch.xpu sees 2 device(s)"
    assert XpuPlatform().device_count() == 2
    assert XpuPlatform.dist_backend == "xccl"

    set_facts(monkeypatch, xpu_device_count=0)
    assert not XpuPlatform.is_available()
    assert xpu.chassis_platform() is None


def test_xpu_detail_on_a_build_without_xpu(monkeypatch: pytest.MonkeyPatch) -> None:
    set_facts(monkeypatch, xpu_built=False, xpu_device_count=0)
    assert XpuPlatform.detection_detail() == "torch is built without XPU support"


# -- TPU ------------------------------------------------------------------------------------


def test_tpu_needs_torch_xla_libtpu_and_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    set_facts(monkeypatch, tpu_device_count=4, libtpu_present=True)
    monkeypatch.setattr(facts, "module_present", lambda name: name == "torch_xla")
    assert TpuPlatform.is_available()
    assert tpu.chassis_platform() is TpuPlatform
    assert TpuPlatform.detection_detail() == "torch_xla sees 4 TPU device(s)"
    assert (TpuPlatform.device_type, TpuPlatform.dist_backend) == ("xla", "xla")

    set_facts(monkeypatch, tpu_device_count=0)
    assert tpu.chassis_platform() is None


def test_tpu_details_say_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(facts, "module_present", lambda name: False)
    assert TpuPlatform.detection_detail() == "torch_xla is not installed"
    monkeypatch.setattr(facts, "module_present", lambda name: name == "torch_xla")
    assert TpuPlatform.detection_detail() == "torch_xla is installed but libtpu is not"


def test_tpu_device_count_is_zero_without_the_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch_xla is installed but libtpu is not: no import of torch_xla is even attempted.
    monkeypatch.setattr(facts, "module_present", lambda name: name == "torch_xla")
    assert facts.tpu_device_count() == 0


# -- the real facts and the CPU (this machine) ----------------------------------------------


def test_real_facts_are_consistent_with_torch() -> None:
    assert facts.cuda_version() == torch.version.cuda
    assert facts.hip_version() == getattr(torch.version, "hip", None)
    assert facts.cuda_device_count() == (
        torch.cuda.device_count() if torch.cuda.is_available() else 0
    )
    assert facts.xpu_device_count() >= 0
    assert facts.module_present("torch") and not facts.module_present("chassis_no_such_xyz")


def test_cuda_device_count_reads_a_broken_runtime_as_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> bool:
        raise RuntimeError("driver too old")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    assert facts.cuda_device_count() == 0


def test_cpu_is_always_available_and_describes_itself() -> None:
    assert CpuPlatform.is_available()
    assert cpu.chassis_platform() is CpuPlatform
    assert CpuPlatform.detection_detail().startswith("always available")
    platform = CpuPlatform()
    assert platform.device_count() == 1
    assert platform.device() == torch.device("cpu")
    assert 0 < platform.memory_available() <= platform.memory_total()
    assert platform.default_dtype() in (torch.bfloat16, torch.float32)
    assert platform.default_dtype() == (torch.bfloat16 if cpu.has_fast_bf16() else torch.float32)
    assert not platform.supports_graph_capture()
    described = platform.describe()
    assert described["device_type"] == "cpu" and described["dist_backend"] == "gloo"
    assert described["devices"] == [platform.device_name()]
