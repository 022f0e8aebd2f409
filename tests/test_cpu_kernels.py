"""The compiled CPU kernels against the torch code of the layers they replace."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from chassis.core.layers.activation import SiluAndMul
from chassis.core.layers.kernels import kernels_for
from chassis.core.layers.norm import RMSNorm
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.platforms import cpu_kernels
from chassis.platforms.cpu_kernels.layer_kernels import CpuLayerKernels

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(scope="module")
def kernels() -> CpuLayerKernels:
    ops = cpu_kernels.load()
    assert ops is not None, "the CPU kernels did not build (is a C++ compiler installed?)"
    return CpuLayerKernels(ops)


def _exact_or_close(actual: torch.Tensor, expected: torch.Tensor, exact: bool = True) -> None:
    """16-bit results are bit-identical (or, where a float32 sum is taken in another order,
    one rounding step apart in rare elements); float32 ones may differ in the last bits."""
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    elif exact:
        assert torch.equal(actual, expected)
    else:
        assert (actual != expected).float().mean().item() < 1e-2
        step = 2**-7 if expected.dtype == torch.bfloat16 else 2**-10
        torch.testing.assert_close(actual, expected, rtol=step, atol=step)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 72, 576])  # 72: a tail past the 16-lane vectors
@pytest.mark.parametrize("tokens", [1, 33])
@torch.no_grad()
def test_rms_norm_matches_module(kernels, dtype, hidden, tokens):
    torch.manual_seed(0)
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    norm.weight.data.normal_()
    x = torch.randn(tokens, hidden).to(dtype) * 3
    residual = torch.randn(tokens, hidden).to(dtype)
    # the mean of squares is summed in another order than torch's: rare one-step differences
    expected = norm.forward_reference(x)
    _exact_or_close(kernels.rms_norm(x, norm.weight, norm.eps), expected, exact=False)
    out, summed = kernels.rms_norm(x, norm.weight, norm.eps, residual)
    ref_out, ref_sum = norm.forward_reference(x, residual)
    _exact_or_close(out, ref_out, exact=False)
    assert torch.equal(summed, ref_sum)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [2 * 1536, 2 * 40])
def test_silu_and_mul_matches_module(kernels, dtype, width):
    torch.manual_seed(0)
    x = (torch.randn(17, width) * 4).to(dtype)
    x[0, :8] = torch.tensor([0.0, -0.0, 30.0, -30.0, 80.0, -80.0, 1e-3, -1e-3])
    expected = SiluAndMul().forward_reference(x)
    actual = kernels.silu_and_mul(x)
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    else:
        # exp differs from torch's vectorized exp by an ulp or two of float32, which can move
        # a 16-bit rounding in rare elements; one step at most
        mismatched = (actual != expected).float().mean().item()
        assert mismatched < 1e-3
        torch.testing.assert_close(actual, expected, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 40])  # 40: half = 20, a vector and a scalar tail
def test_rotary_matches_module_on_fused_qkv_views(kernels, dtype, head_dim):
    torch.manual_seed(0)
    heads, kv_heads, tokens = 6, 2, 9
    rope = RotaryEmbedding(head_dim, 4096, {"rope_type": "default", "rope_theta": 10000.0})
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    positions = torch.tensor([0, 1, 5, 17, 100, 1023, 2047, 3000, 4095])

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = t[:, : heads * head_dim].view(tokens, heads, head_dim)
        k = t[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
        return q, k

    ref_q, ref_k = rope.forward_reference(positions, *views(qkv))
    fused = qkv.clone()
    q, k = views(fused)
    kernels.rotary_embedding_(positions, q, k, rope.cos_cache, rope.sin_cache)
    _exact_or_close(q, ref_q)
    _exact_or_close(k, ref_k)
    # only q and k were written: v is untouched
    v_start = (heads + kv_heads) * head_dim
    assert torch.equal(fused[:, v_start:], qkv[:, v_start:])


def test_layers_use_the_platform_kernels_on_the_cpu(kernels):
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert kernels_for(x) is not None
    # autograd needs the torch code (the kernels define no backward)
    assert kernels_for(torch.randn(3, 64, requires_grad=True)) is None
    assert kernels_for(torch.zeros(3, dtype=torch.int64)) is None


def test_rotary_rejects_positions_past_its_cache(kernels):
    rope = RotaryEmbedding(16, 8, {"rope_type": "default", "rope_theta": 10000.0})
    q, k = torch.zeros(1, 1, 16), torch.zeros(1, 1, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.rotary_embedding_(torch.tensor([8]), q, k, rope.cos_cache, rope.sin_cache)


@pytest.fixture
def fresh_load(monkeypatch, tmp_path):
    """``cpu_kernels.load`` with its memo cleared (and cleared again afterwards)."""
    monkeypatch.setenv("CHASSIS_CACHE_DIR", str(tmp_path))
    cpu_kernels.load.cache_clear()
    yield cpu_kernels.load
    cpu_kernels.load.cache_clear()


def test_switched_off_by_environment(fresh_load, monkeypatch, tmp_path):
    monkeypatch.setenv("CHASSIS_CPU_KERNELS", "0")
    assert fresh_load() is None
    assert not list(tmp_path.iterdir())  # nothing compiled


def test_failed_build_falls_back_with_a_warning(fresh_load, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    with caplog.at_level(logging.WARNING, logger="chassis.platforms.cpu_kernels"):
        assert fresh_load() is None
    assert "CPU kernels unavailable" in caplog.text
    assert not list((tmp_path / "cpu_kernels").glob("*.so"))  # no half-written library left


def test_decode_attention_rejects_block_ids_outside_the_cache(kernels):
    cache = torch.zeros(4, 2, 4, 1, 16)
    query = torch.zeros(1, 2, 16)
    table = torch.tensor([[0, 7]], dtype=torch.int32)  # the second block id is out of range
    with pytest.raises(RuntimeError, match="not a block of this cache"):
        kernels.ops.decode_attention(query, cache, table, torch.tensor([6], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="needs more blocks"):
        kernels.ops.decode_attention(query, cache, table, torch.tensor([9], dtype=torch.int32), 1.0)
    # ids past a row's length are never read, so they may be anything
    out = kernels.ops.decode_attention(
        query, cache, table, torch.tensor([3], dtype=torch.int32), 1.0
    )
    assert out.shape == (1, 2, 16) and torch.isfinite(out).all()


def _attention_reference(query, cache, table, lens, scale, window=0, cap=0.0):
    """float32 softmax attention of each query row over its context, read through the table
    (only its last ``window`` positions if ``window``; scores ``cap * tanh(s / cap)`` if
    ``cap``)."""
    out = torch.empty(query.shape, dtype=torch.float32)
    block_size, kv_heads = cache.shape[2], cache.shape[3]
    group = query.shape[1] // kv_heads
    for b in range(query.shape[0]):
        length = int(lens[b])
        pos = torch.arange(max(0, length - window) if window else 0, length)
        blocks = table[b, pos // block_size].long()
        k = cache[blocks, 0, pos % block_size].float().repeat_interleave(group, dim=1)
        v = cache[blocks, 1, pos % block_size].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[b].float(), k) * scale
        if cap:
            scores = cap * torch.tanh(scores / cap)
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
    return out


def _decode_batch(lens: list[int], heads: int, kv_heads: int, head_dim: int, dtype):
    """``(query, cache, table, seq_lens, scale, block_size)``: one decode query per length
    over a random cache of 16-token blocks, each row's blocks a random permutation (3 spare)."""
    block_size = 16
    blocks_per_row = -(-max(lens) // block_size)
    cache = torch.randn(len(lens) * blocks_per_row + 3, 2, block_size, kv_heads, head_dim)
    cache = cache.to(dtype)
    table = torch.randperm(cache.shape[0])[: len(lens) * blocks_per_row]
    table = table.view(len(lens), blocks_per_row).to(torch.int32)
    query = torch.randn(len(lens), heads, head_dim).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return query, cache, table, seq_lens, head_dim**-0.5, block_size


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (9, 3)])
def test_decode_attention_matches_float32_softmax(kernels, dtype, head_dim, heads, kv_heads):
    # lengths that end mid-chunk (odd, so the bf16 path's position pairs end half-empty),
    # span several blocks, and batches past 2 x threads (whole requests per work item)
    torch.manual_seed(0)
    lens = [1, 15, 16, 17, 33, 100, 7]
    query, cache, table, seq_lens, scale, _ = _decode_batch(lens, heads, kv_heads, head_dim, dtype)
    actual = kernels.ops.decode_attention(query, cache, table, seq_lens, scale)
    expected = _attention_reference(query, cache, table, seq_lens, scale)
    # bfloat16: the softmax weights are rounded to bfloat16 before p.v (as GPU kernels do)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(actual.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 128, 24])  # 24: the portable (scalar) path
@pytest.mark.parametrize(("window", "cap"), [(5, 0.0), (0, 1.5), (20, 0.7), (1, 0.0)])
def test_decode_attention_window_and_soft_cap(kernels, dtype, head_dim, window, cap):
    """Windows that start mid-chunk, past a row's start and (1) at the row itself; caps that
    bind. Positions before a row's window hold NaN: the kernel must not read them."""
    torch.manual_seed(1)
    lens, heads, kv_heads = [1, 15, 16, 17, 33, 100, 7, 21], 6, 2
    query, cache, table, seq_lens, scale, block_size = _decode_batch(
        lens, heads, kv_heads, head_dim, dtype
    )
    expected = _attention_reference(query, cache, table, seq_lens, scale, window, cap)
    if window:
        for b, length in enumerate(lens):
            pos = torch.arange(max(0, length - window))
            cache[table[b, pos // block_size].long(), :, pos % block_size] = float("nan")
    actual = kernels.ops.decode_attention(query, cache, table, seq_lens, scale, window, cap)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(actual.float(), expected, rtol=tol, atol=tol)
    with pytest.raises(RuntimeError, match=">= 0"):
        kernels.ops.decode_attention(query, cache, table, seq_lens, scale, -1, cap)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_stores_rows_at_their_slots(kernels, dtype):
    torch.manual_seed(0)
    num_blocks, block_size, kv_heads, dim = 5, 4, 2, 8
    cache = torch.zeros(num_blocks, 2, block_size, kv_heads, dim, dtype=dtype)
    # K and V as the strided views a fused QKV projection gives
    qkv = torch.randn(6, 3 * kv_heads * dim).to(dtype)
    key = qkv[:, kv_heads * dim : 2 * kv_heads * dim].view(6, kv_heads, dim)
    value = qkv[:, 2 * kv_heads * dim :].view(6, kv_heads, dim)
    slots = torch.tensor([0, 7, -1, 19, 5])  # the 6th token is not written; -1 is padding
    kernels.ops.write_kv(key, value, cache, slots)
    expected = torch.zeros_like(cache)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // block_size, 0, slot % block_size] = key[i]
            expected[slot // block_size, 1, slot % block_size] = value[i]
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.ops.write_kv(key, value, cache, torch.tensor([num_blocks * block_size]))


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize(
    ("window", "cap"), [(0, 0.0), (5, 0.0), (0, 1.5), (40, 0.7), (1, 0.0)], ids=str
)
def test_prefill_attention_matches_float32_softmax(kernels, head_dim, heads, kv_heads, window, cap):
    if not kernels.ops.prefill_attention_supported(torch.bfloat16, head_dim, heads // kv_heads):
        pytest.skip("tiled prefill attention needs AVX512-BF16")
    torch.manual_seed(0)
    block_size = 16
    # (prefix already cached, query length): whole prompts, chunks after a cached prefix,
    # tiles ending mid-block, a single-token chunk, a context past 512 positions
    chunks = [(0, 37), (20, 16), (5, 1), (48, 40), (0, 16), (530, 20)]
    blocks_per_row = -(-max(p + q for p, q in chunks) // block_size)
    cache = torch.randn(len(chunks) * blocks_per_row + 2, 2, block_size, kv_heads, head_dim)
    cache = cache.to(torch.bfloat16)
    table = torch.randperm(cache.shape[0])[: len(chunks) * blocks_per_row]
    table = table.view(len(chunks), blocks_per_row).to(torch.int32)
    # the chunks' tokens in reverse order after 3 tokens of no chunk (a step's decodes)
    starts, at = [0] * len(chunks), 3
    for i in reversed(range(len(chunks))):
        starts[i], at = at, at + chunks[i][1]
    query = torch.randn(at, heads, head_dim).to(torch.bfloat16)
    out = torch.full_like(query, 7.0)
    scale = head_dim**-0.5

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    seq_lens = i32([p + q for p, q in chunks])
    query_lens = i32([q for _, q in chunks])
    options = () if window == 0 and cap == 0.0 else (window, cap)  # the defaults: off
    reference_cache = cache.clone()
    if window:  # no row of a chunk sees what lies before its first row's window: NaN there
        for i, (prefix, _) in enumerate(chunks):
            pos = torch.arange(max(0, prefix - window + 1))
            cache[table[i, pos // block_size].long(), :, pos % block_size] = float("nan")
    kernels.ops.prefill_attention(
        query, cache, table, seq_lens, i32(starts), query_lens, scale, out, *options
    )
    for i, (prefix, q_len) in enumerate(chunks):
        # every token of the chunk as its own row over its causal context (or window)
        tokens = slice(starts[i], starts[i] + q_len)
        lens = torch.arange(prefix + 1, prefix + q_len + 1, dtype=torch.int32)
        expected = _attention_reference(
            query[tokens], reference_cache, table[[i] * q_len], lens, scale, window, cap
        )
        torch.testing.assert_close(out[tokens].float(), expected, rtol=2e-2, atol=2e-2)
    assert (out[:3] == 7.0).all()  # tokens outside the chunks untouched


def test_prefill_attention_rejects_bad_chunks(kernels):
    if not kernels.ops.prefill_attention_supported(torch.bfloat16, 64, 1):
        pytest.skip("tiled prefill attention needs AVX512-BF16")
    cache = torch.zeros(4, 2, 16, 1, 64, dtype=torch.bfloat16)
    query = torch.zeros(8, 1, 64, dtype=torch.bfloat16)
    table = torch.tensor([[0, 9]], dtype=torch.int32)
    start, length = torch.tensor([0], dtype=torch.int32), torch.tensor([8], dtype=torch.int32)
    out = torch.empty_like(query)

    def run(seq_len: int, dtype: torch.dtype = torch.bfloat16) -> None:
        seq_lens = torch.tensor([seq_len], dtype=torch.int32)
        kernels.ops.prefill_attention(
            query.to(dtype), cache.to(dtype), table, seq_lens, start, length, 1.0, out.to(dtype)
        )

    with pytest.raises(RuntimeError, match="not a block of this cache"):
        run(20)
    with pytest.raises(RuntimeError, match="number at most seq_lens"):
        run(4)
    with pytest.raises(RuntimeError, match="does not run this dtype"):
        run(8, torch.float32)
    # two chunks over the same query tokens would write the same output rows concurrently
    with pytest.raises(RuntimeError, match="chunks overlap"):
        kernels.ops.prefill_attention(
            query,
            cache,
            torch.tensor([[0], [1]], dtype=torch.int32),
            torch.tensor([8, 8], dtype=torch.int32),
            torch.tensor([0, 4], dtype=torch.int32),
            torch.tensor([8, 4], dtype=torch.int32),
            1.0,
            out,
        )


def test_engine_generates_with_the_compiled_kernels_off(smollm2_dir):
    """The bf16 engine on the torch fallbacks (oneDNN-packed linears, SDPA attention): the
    path of CPUs without a compiler or AVX512-BF16. A child process, since a process loads
    the kernels once."""
    code = (
        "from chassis import LLM, SamplingParams\n"
        f"llm = LLM({str(smollm2_dir)!r}, dtype='bfloat16')\n"
        "out = llm.generate(['The capital of France is'], SamplingParams(temperature=0, max_tokens=8))\n"
        "print(len(out[0].outputs[0].token_ids))\n"
    )
    env = {**os.environ, "CHASSIS_CPU_KERNELS": "0"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "8"
