"""``triton_paged`` compiled on a real GPU at model shapes (run by tests/gpu/run_gpu_checks.sh).

Shapes: Qwen3-0.6B (16 q heads, 8 kv heads, head_dim 128), SmolLM2 (9/3, 64) and Qwen2-0.5B
(14/2, 64), cache blocks of 16; Gemma-2-2B (8/4, 256) for sliding windows and logit soft caps;
gpt-oss-20b (64/8, 64) for attention sinks.
Checks against the dense float32 reference and the ``torch_paged`` backend, the split-KV
decode path, CUDA-graph replay with new metadata, the absence of device->host syncs, and
cache offsets past 2**31 elements.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ helpers

from paged_attention_cases import dense_attention, make_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]

QWEN3 = (16, 8, 128)
#: make_batch arguments of a Qwen3-0.6B bfloat16 step on the GPU (cache blocks of 16)
QWEN3_BF16 = dict(
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    block_size=16,
    dtype=torch.bfloat16,
    device="cuda",
)
#: prefills over prefixes of many lengths, a long prefill, decodes over short and long contexts
MIXED = [(0, 300), (100, 57), (511, 1), (0, 1), (1500, 1), (33, 200), (2047, 1), (7, 16)]
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _backend(num_heads: int, num_kv_heads: int, head_dim: int):
    from chassis.builtin_plugins.attention.triton_paged import TritonPagedAttention

    return TritonPagedAttention(num_heads, head_dim, num_kv_heads, head_dim**-0.5)


def _check(
    out: torch.Tensor,
    batch,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    n = batch.metadata.num_actual_tokens
    tol = TOL[out.dtype]
    expected = dense_attention(batch, scale, sliding_window, logits_soft_cap)
    torch.testing.assert_close(out[:n].float().cpu(), expected, atol=tol, rtol=tol)


GEMMA2 = (8, 4, 256)


@pytest.mark.parametrize(
    ("shape", "dtype", "sliding_window", "soft_cap"),
    [
        (GEMMA2, torch.bfloat16, 256, 50.0),  # Gemma 2's cap, a window shorter than MIXED's
        (GEMMA2, torch.bfloat16, None, 1.0),  # a cap that binds, full attention
        (GEMMA2, torch.float32, 100, 1.0),
        (QWEN3, torch.bfloat16, 300, None),  # Mistral-like: a window alone
        (QWEN3, torch.float16, 4096, None),  # a window past every context
        ((9, 3, 64), torch.bfloat16, 17, 5.0),  # a window that is not a tile multiple
    ],
    ids=str,
)
def test_sliding_window_and_soft_cap_match_dense(
    shape, dtype: torch.dtype, sliding_window: int | None, soft_cap: float | None
) -> None:
    """Mixed batch at model shapes: tiles before each query block's window are skipped, the
    rest masked; scores capped in the kernel. Slots no request owns hold NaN."""
    num_heads, num_kv_heads, head_dim = shape
    batch = make_batch(
        MIXED,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        device="cuda",
        num_pad_tokens=5,
    )
    from chassis.builtin_plugins.attention.triton_paged import TritonPagedAttention

    backend = TritonPagedAttention(
        num_heads,
        head_dim,
        num_kv_heads,
        head_dim**-0.5,
        sliding_window=sliding_window,
        logits_soft_cap=soft_cap,
    )
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    _check(out, batch, backend.scale, sliding_window, soft_cap)


def test_windowed_decode_splits_what_the_window_leaves() -> None:
    """Split-KV decodes with a window divide the window's tiles, not the context's; the split
    and unsplit results agree, and with the cap too."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    batch = make_batch([(4000, 1), (1000, 1), (17, 1), (600, 1)], **QWEN3_BF16)
    kernels.write_kv_cache(batch.key, batch.value, batch.kv_cache, batch.metadata.slot_mapping)
    args = {**batch.kernel_args(128**-0.5), "sliding_window": 512, "logits_soft_cap": 20.0}
    split_out, single_out = torch.empty_like(batch.query), torch.empty_like(batch.query)
    config = kernels.paged_attention(batch.query, batch.kv_cache, split_out, **args)
    assert config.num_splits > 1, config
    kernels.paged_attention(batch.query, batch.kv_cache, single_out, num_splits=1, **args)
    _check(split_out, batch, 128**-0.5, 512, 20.0)
    torch.testing.assert_close(split_out, single_out, atol=1e-2, rtol=1e-2)


#: gpt-oss-20b's attention: 64 q heads over 8 kv heads of 64, windows of 128 on half the layers
GPT_OSS = (64, 8, 64)


@pytest.mark.parametrize("sliding_window", [128, None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_sinks_match_dense(sliding_window: int | None, dtype: torch.dtype) -> None:
    """The HAS_SINKS variant at gpt-oss's shape (the sinks a parameter of the model dtype),
    over the mixed batch, and split-KV decodes against unsplit ones (only split 0 carries
    the sink)."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels
    from chassis.builtin_plugins.attention.triton_paged import TritonPagedAttention

    num_heads, num_kv_heads, head_dim = GPT_OSS
    shape = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    sinks = (2 * torch.randn(num_heads, generator=torch.Generator().manual_seed(0))).to(dtype)
    sinks = sinks.cuda()
    batch = make_batch(MIXED, **shape, block_size=16, dtype=dtype, device="cuda", num_pad_tokens=5)
    backend = TritonPagedAttention(
        num_heads,
        head_dim,
        num_kv_heads,
        head_dim**-0.5,
        sliding_window=sliding_window,
        sinks=sinks,
    )
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    n, tol = batch.metadata.num_actual_tokens, TOL[dtype]
    expected = dense_attention(batch, backend.scale, sliding_window, None, sinks)
    torch.testing.assert_close(out[:n].float().cpu(), expected, atol=tol, rtol=tol)

    decodes = make_batch(
        [(4000, 1), (1000, 1), (17, 1)], **shape, block_size=16, dtype=dtype, device="cuda"
    )
    kernels.write_kv_cache(
        decodes.key, decodes.value, decodes.kv_cache, decodes.metadata.slot_mapping
    )
    args = {**decodes.kernel_args(head_dim**-0.5), "sliding_window": sliding_window}
    split_out, single_out = torch.empty_like(decodes.query), torch.empty_like(decodes.query)
    config = kernels.paged_attention(
        decodes.query, decodes.kv_cache, split_out, num_splits=4, sinks=sinks, **args
    )
    assert config.num_splits == 4
    kernels.paged_attention(
        decodes.query, decodes.kv_cache, single_out, num_splits=1, sinks=sinks, **args
    )
    expected = dense_attention(decodes, head_dim**-0.5, sliding_window, None, sinks)
    torch.testing.assert_close(split_out.float().cpu(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(split_out, single_out, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("shape", "dtype", "block_size"),
    [
        (QWEN3, torch.bfloat16, 16),
        (QWEN3, torch.float16, 16),
        (QWEN3, torch.float32, 16),
        (QWEN3, torch.bfloat16, 32),
        ((9, 3, 64), torch.bfloat16, 16),
        ((14, 2, 64), torch.bfloat16, 16),
    ],
    ids=str,
)
def test_mixed_batch_matches_dense(shape, dtype: torch.dtype, block_size: int) -> None:
    num_heads, num_kv_heads, head_dim = shape
    batch = make_batch(
        MIXED,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device="cuda",
        num_pad_tokens=5,
    )
    backend = _backend(num_heads, num_kv_heads, head_dim)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    torch.testing.assert_close(batch.kv_cache, batch.expected_cache, atol=0, rtol=0, equal_nan=True)
    _check(out, batch, backend.scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_torch_paged(dtype: torch.dtype) -> None:
    from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention

    shape = dict(
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype=dtype,
        device="cuda",
        num_pad_tokens=3,
        unwritten_fill=1e4,
    )
    ours_batch, ref_batch = make_batch(MIXED, **shape), make_batch(MIXED, **shape)
    ours = _backend(16, 8, 128).forward(
        ours_batch.query, ours_batch.key, ours_batch.value, ours_batch.kv_cache, ours_batch.metadata
    )
    ref = TorchPagedAttention(16, 128, 8, 128**-0.5).forward(
        ref_batch.query, ref_batch.key, ref_batch.value, ref_batch.kv_cache, ref_batch.metadata
    )
    n = ours_batch.metadata.num_actual_tokens
    torch.testing.assert_close(ours[:n], ref[:n], atol=2 * TOL[dtype], rtol=2 * TOL[dtype])


def test_decode_splits_kv_when_the_gpu_would_idle() -> None:
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    batch = make_batch(
        [(4000, 1), (1000, 1), (17, 1)],
        **QWEN3_BF16,
    )
    kernels.write_kv_cache(batch.key, batch.value, batch.kv_cache, batch.metadata.slot_mapping)
    args = batch.kernel_args(128**-0.5)
    split_out, single_out = torch.empty_like(batch.query), torch.empty_like(batch.query)
    config = kernels.paged_attention(batch.query, batch.kv_cache, split_out, **args)
    assert config.num_splits > 1, config
    kernels.paged_attention(batch.query, batch.kv_cache, single_out, num_splits=1, **args)
    _check(split_out, batch, 128**-0.5)
    torch.testing.assert_close(split_out, single_out, atol=1e-2, rtol=1e-2)


def _num_compiled(kernel) -> int:
    """Compiled variants of a ``@triton.jit`` kernel so far, every device together."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton version keeps its compiled kernels elsewhere")
    return sum(len(entry[0]) for entry in caches.values())


def test_new_step_shapes_compile_nothing_after_the_first() -> None:
    """Block tables of other widths (strides 1, 15, 16, 17, 32, 48: the value classes Triton
    specializes integers on) and other split counts reuse the compiled kernels: an eager step
    of a new shape must not stop a benchmark for a Triton compile."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    long_ctx, short_ctx = [(200, 1), (90, 1)], [(5, 1), (9, 1)]  # 13 blocks; 1 block
    steps = [(long_ctx, 15, 2), (long_ctx, 16, 3), (short_ctx, 1, 5), (long_ctx, 17, 16)]
    steps += [(long_ctx, 32, 4), (long_ctx, 48, 2)]
    compiled = None
    for specs, width, num_splits in steps:
        batch = make_batch(
            specs,
            **QWEN3_BF16,
            max_blocks=width,
        )
        kernels.write_kv_cache(batch.key, batch.value, batch.kv_cache, batch.metadata.slot_mapping)
        out = torch.empty_like(batch.query)
        kernels.paged_attention(
            batch.query, batch.kv_cache, out, num_splits=num_splits, **batch.kernel_args(0.1)
        )
        _check(out, batch, 0.1)
        counts = (
            _num_compiled(kernels._paged_attention_kernel),
            _num_compiled(kernels._combine_kernel),
        )
        compiled = compiled or counts
        assert counts == compiled, (width, num_splits)


def test_forward_never_syncs_with_the_host() -> None:
    batch = make_batch(
        MIXED,
        **QWEN3_BF16,
    )
    backend = _backend(16, 8, 128)
    args = (batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    backend.forward(*args)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.forward(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize(
    "specs_b",
    [[(900, 1), (3, 1), (60, 1), (250, 1)], [(3, 1), (1900, 1), (60, 1), (10, 1)]],
    ids=["same-max", "longer-max"],
)
def test_cuda_graph_replays_with_new_metadata(specs_b) -> None:
    """Capture a decode step, then replay it on other lengths and blocks of the same shapes."""
    shape = dict(
        **QWEN3_BF16,
        num_blocks=200,
        max_blocks=130,
        unwritten_fill=0.0,
    )
    a = make_batch([(250, 1), (60, 1), (3, 1), (900, 1)], seed=1, **shape)
    b = make_batch(specs_b, seed=2, **shape)
    backend = _backend(16, 8, 128)
    static = (a.query, a.key, a.value, a.kv_cache, a.metadata)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(*static)  # compile and warm up before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(*static)
    graph.replay()
    _check(out, a, backend.scale)

    for name in ("query", "key", "value", "kv_cache"):
        getattr(a, name).copy_(getattr(b, name))
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        getattr(a.metadata, name).copy_(getattr(b.metadata, name))
    graph.replay()
    _check(out, b, backend.scale)


def test_cache_offsets_beyond_int32() -> None:
    """Blocks at the end of a cache of more than 2**31 elements are addressed correctly."""
    num_blocks, block_size, heads, kv_heads, dim = 70_000, 16, 16, 8, 128
    cache = torch.empty(
        num_blocks, 2, block_size, kv_heads, dim, dtype=torch.bfloat16, device="cuda"
    )
    assert cache.numel() > 2**31
    from chassis.core.attention import AttentionMetadata

    q_len = 20
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(q_len, heads, dim, device="cuda", generator=gen).bfloat16()
    k = torch.randn(q_len, kv_heads, dim, device="cuda", generator=gen).bfloat16()
    v = torch.randn(q_len, kv_heads, dim, device="cuda", generator=gen).bfloat16()
    blocks = torch.tensor([[num_blocks - 1, num_blocks - 2]], dtype=torch.int32, device="cuda")
    pos = torch.arange(q_len, device="cuda")
    slots = blocks[0].long()[pos // block_size] * block_size + pos % block_size
    qsl = torch.tensor([0, q_len], dtype=torch.int32)
    lens = torch.tensor([q_len], dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=q_len,
        num_reqs=1,
        query_start_loc=qsl.cuda(),
        seq_lens=lens.cuda(),
        block_table=blocks,
        slot_mapping=slots,
        max_query_len=q_len,
        max_seq_len=q_len,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
    )
    backend = _backend(heads, kv_heads, dim)
    out = backend.forward(q, k, v, cache, meta)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        k.transpose(0, 1).float(),
        v.transpose(0, 1).float(),
        is_causal=True,
        scale=backend.scale,
        enable_gqa=True,
    ).transpose(0, 1)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
