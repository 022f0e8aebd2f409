"""The CPU platform's KV cache zeros (platforms/cpu_lazy_zeros.py): zeros, writable, the
requested shape and dtype, whatever their size."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from chassis.platforms.cpu import CpuPlatform
from chassis.platforms.cpu_lazy_zeros import LAZY_MIN_BYTES, lazy_zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_blocks", [1, 600])  # below and above LAZY_MIN_BYTES
def test_lazy_zeros_equal_torch_zeros(dtype: torch.dtype, num_blocks: int) -> None:
    shape = (num_blocks, 2, 16, 3, 64)
    tensor = lazy_zeros(shape, dtype)
    assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
    assert torch.equal(tensor.view(torch.uint8), torch.zeros(shape, dtype=dtype).view(torch.uint8))
    tensor[-1, 1, 15] = 1.5  # writable, and a write lands where indexing says
    assert tensor.float().sum().item() == 1.5 * 3 * 64


def test_a_view_keeps_the_mapping_alive() -> None:
    tensor = lazy_zeros((LAZY_MIN_BYTES // 4 + 10,), torch.float32)
    assert tensor.data_ptr() % 4096 == 0  # a fresh mapping, page-aligned
    tail = tensor[-10:]
    tail += 2.0
    del tensor
    gc.collect()
    assert tail.tolist() == [2.0] * 10


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="Linux /proc needed")
def test_the_cpu_platform_gives_its_kv_caches_lazily() -> None:
    """The cache costs no resident memory until written, and then only the pages written
    (torch.zeros would make all 256 MiB resident at once)."""
    platform = CpuPlatform()
    shape = (16384, 2, 16, 4, 64)  # 256 MiB of float32
    before = _resident_bytes()
    cache = platform.kv_cache_zeros(shape, torch.float32, torch.device("cpu"))
    assert cache.shape == shape and cache.device.type == "cpu"
    cache[:64] = 1.0  # the first 64 blocks: 1 MiB
    assert _resident_bytes() - before < 32 << 20
    assert cache[64:].count_nonzero() == 0  # reads of untouched pages map no new memory
    assert _resident_bytes() - before < 32 << 20


def test_a_refused_mapping_falls_back_to_torch_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel refuses the mapping (ENOMEM: strict overcommit accounting,
    ``vm.max_map_count`` reached), the cache is ``torch.zeros``, whose allocator then says
    how many bytes it could not get, instead of a bare ``OSError`` at engine start."""
    import errno
    import mmap

    def refuse(*args: object, **kwargs: object) -> mmap.mmap:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    shape = (LAZY_MIN_BYTES // 4 + 10,)
    tensor = lazy_zeros(shape, torch.float32)
    assert tensor.shape == shape and not tensor.any()
