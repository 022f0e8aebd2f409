"""``--kv-cache-dtype fp8`` on a real GPU (run by tests/gpu/run_gpu_checks.sh's pytest step).

What the CPU tests (tests/test_fp8_kv_cache.py) cannot check: Triton's interpreter rounds
float32 -> fp8 wrongly, so the write kernel's rounding of arbitrary values (``cvt.rn.satfinite``
on sm_89+) is compared bit for bit with ``torch_paged.quantize_kv`` here; the attention kernel
reads the fp8 cache at Qwen3-0.6B shapes (16 q / 8 kv heads, dim 128) as ``torch_paged`` does;
and the engine with an fp8 cache replays CUDA graphs with the eager path's tokens, makes no
host sync in a decode step, and fits twice the blocks of a bfloat16 cache.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ helpers

from paged_attention_cases import make_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
QWEN3_BF16 = dict(
    num_heads=16, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16, device="cuda"
)
MIXED = [(0, 300), (100, 57), (511, 1), (0, 1), (1500, 1), (33, 200), (2047, 1), (7, 16)]


def _fp8_cache(kv_cache: torch.Tensor, fp8: torch.dtype, k_scale: float, v_scale: float):
    from chassis.builtin_plugins.attention.torch_paged import quantize_kv

    cache = torch.empty_like(kv_cache, dtype=fp8)
    cache[:, 0] = quantize_kv(kv_cache[:, 0], fp8, k_scale)
    cache[:, 1] = quantize_kv(kv_cache[:, 1], fp8, v_scale)
    return cache


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("scales", [(1.0, 1.0), (2.0, 0.5), (0.37, 2.5)], ids=str)
def test_write_kernel_rounds_as_torch(fp8: torch.dtype, scales: tuple[float, float]) -> None:
    """Arbitrary bf16 K/V (N(0, 30), some 1e5: saturated): the same bytes as torch's
    ``clamp(x / scale).to(fp8)``. A scale that is not a power of two may round ``x / scale``
    differently in Triton's float32 division: then at most a few elements in 10^4 differ."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels
    from chassis.builtin_plugins.attention.torch_paged import write_kv_cache

    batch = make_batch(MIXED, **QWEN3_BF16, unwritten_fill=0.0)
    n = batch.metadata.num_actual_tokens
    key, value = batch.key * 30, batch.value * 30
    key.view(-1)[::97] = 1e5
    value.view(-1)[::89] = -1e5
    ref = _fp8_cache(batch.kv_cache, fp8, *scales)
    got = ref.clone()
    k_scale, v_scale = scales
    write_kv_cache(
        ref, key[:n], value[:n], batch.metadata.slot_mapping, k_scale=k_scale, v_scale=v_scale
    )
    kernels.write_kv_cache(
        key, value, got, batch.metadata.slot_mapping, k_scale=k_scale, v_scale=v_scale
    )
    differ = (got.view(torch.uint8) != ref.view(torch.uint8)).float().mean().item()
    if scales in ((1.0, 1.0), (2.0, 0.5)):
        assert differ == 0.0
    else:
        assert differ < 1e-3
    assert not got.float().isnan().any()


def _triton_attention(batch, cache, scale: float, **options) -> torch.Tensor:
    """``triton_paged_kernels.paged_attention`` of ``batch``'s queries over ``cache``."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    out = torch.empty_like(batch.query)
    kernels.paged_attention(batch.query, cache, out, **batch.kernel_args(scale), **options)
    return out


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("num_splits", [None, 8])
def test_attention_reads_the_cache_as_torch_paged(fp8: torch.dtype, num_splits) -> None:
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels
    from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention

    batch = make_batch(MIXED, **QWEN3_BF16, unwritten_fill=60.0)
    n = batch.metadata.num_actual_tokens
    scale = 128**-0.5
    k_scale, v_scale = 1.5, 0.75
    fp8_options = dict(num_splits=num_splits, k_scale=k_scale, v_scale=v_scale)
    cache = _fp8_cache(batch.kv_cache, fp8, k_scale, v_scale)
    ref_backend = TorchPagedAttention(16, 128, 8, scale)
    ref_backend.k_scale, ref_backend.v_scale = k_scale, v_scale
    # the read path alone: the kernel attends over the cache torch_paged wrote
    ref = ref_backend.forward(batch.query, batch.key, batch.value, cache, batch.metadata)
    out = _triton_attention(batch, cache, scale, **fp8_options)
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=1e-2, rtol=1e-2)
    # written by the kernel too, and within fp8 rounding of a bfloat16 cache (see
    # tests/test_fp8_kv_cache.py)
    cache = _fp8_cache(batch.kv_cache, fp8, k_scale, v_scale)
    kernels.write_kv_cache(
        batch.key,
        batch.value,
        cache,
        batch.metadata.slot_mapping,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    out = _triton_attention(batch, cache, scale, **fp8_options)
    bf16_cache = batch.kv_cache.clone()
    kernels.write_kv_cache(batch.key, batch.value, bf16_cache, batch.metadata.slot_mapping)
    bf16_out = _triton_attention(batch, bf16_cache, scale)
    rel = (out[:n].float() - bf16_out[:n].float()).norm() / bf16_out[:n].float().norm()
    assert rel < (0.05 if fp8 == torch.float8_e4m3fn else 0.1), rel


def test_engine_graphs_blocks_and_no_host_syncs(tmp_path, monkeypatch) -> None:
    from test_gpu_engine import PROMPT_LENS, VOCAB, chassis_greedy, write_tiny_qwen3
    from test_gpu_host_syncs import DECODE_STEPS, _syncs_per_decode_step

    from chassis.core.llm import LLM

    write_tiny_qwen3(tmp_path)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    common = dict(kv_cache_dtype="fp8", max_model_len=256, max_num_batched_tokens=32)
    eager = chassis_greedy(tmp_path, prompts, enforce_eager=True, num_kv_blocks=128, **common)
    graphs = chassis_greedy(tmp_path, prompts, num_kv_blocks=128, **common)
    assert graphs == eager

    blocks = {}
    for kv in ("auto", "fp8"):
        llm = LLM(
            str(tmp_path),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            kv_cache_memory=64 * 2**20,
            kv_cache_dtype=kv,
            enforce_eager=True,
        )
        blocks[kv] = llm.engine.info.num_kv_blocks
        assert llm.engine.info.attention_backend == "triton_paged"
        del llm
    assert blocks["fp8"] == 2 * blocks["auto"], blocks

    counts = _syncs_per_decode_step(tmp_path, monkeypatch, kv_cache_dtype="fp8")
    assert counts == [(1, 0)] * DECODE_STEPS, f"(event waits, other syncs) per step: {counts}"
