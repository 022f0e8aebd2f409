"""``triton_paged`` compiled on a real GPU at model shapes (run by tests/gpu/run_gpu_checks.sh).

Shapes: Qwen3-0.6B (16 q heads, 8 kv heads, head_dim 128), SmolLM2 (9/3, 64) and Qwen2-0.5B
(14/2, 64), cache blocks of 16; Gemma-2-2B (8/4, 256) for sliding windows and logit soft caps;
gpt-oss-20b (64/8, 64) for attention sinks.
Checks against the dense float32 reference and the ``torch_paged`` backend, the split-KV
decode path, CUDA-graph replay with new metadata, the absence of device->host syncs, and
cache offsets past 2**31 elements; and the fused decode path (CHASSIS_FUSED_DECODE_ATTENTION=1:
the K/V write and the split merge inside the attention kernel) against the separate kernels,
the dense reference, 200 back-to-back launches, fp8 caches and a captured graph's replays.
"""

from __future__ import annotations

import sys
import warnings
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


# -- CHASSIS_FUSED_DECODE_ATTENTION=1: K/V write and split merge inside the attention kernel --

#: decodes over long and short contexts (new tokens at a block's first, middle and last
#: slot), for the fused decode path
FUSED_DECODES = [(4000, 1), (1000, 1), (17, 1), (600, 1), (0, 1), (15, 1), (16, 1)]
#: one rounding step of each output dtype, relative (bfloat16 keeps 8 significant bits)
ROUNDING = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-22}


def _fused_and_separate(batch, scale: float, **args):
    """The decode step by the separate kernels (write, attention, combine) and by the fused
    attention kernel, each on its own copy of the batch's cache (slots of the new tokens hold
    NaN before: a read of the slot before its write shows): ``(separate output, fused output,
    separate cache, fused cache)``."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    m = batch.metadata
    new_kv = dict(key=batch.key, value=batch.value, slot_mapping=m.slot_mapping)
    results = []
    for fuse in (False, True):
        cache = batch.kv_cache.clone()
        out = torch.empty_like(batch.query)
        kernels.paged_attention(
            batch.query,
            cache,
            out,
            **batch.kernel_args(scale),
            **new_kv,
            fuse_kv_write=fuse,
            fuse_combine=fuse,
            **args,
        )
        results.append((out[: m.num_actual_tokens], cache))
    (separate, separate_cache), (fused, fused_cache) = results
    return separate, fused, separate_cache, fused_cache


def _assert_within_one_rounding(fused: torch.Tensor, separate: torch.Tensor) -> None:
    """Equal, or (the merge's reductions laid out differently by the compiler) within one
    rounding step of the dtype; a warning tells the next session how many differ."""
    differ = int((fused != separate).sum())
    if differ:
        warnings.warn(
            f"fused decode differs from the separate kernels in {differ} of "
            f"{separate.numel()} {separate.dtype} outputs",
            stacklevel=2,
        )
    step = ROUNDING[separate.dtype]
    torch.testing.assert_close(fused, separate, atol=step, rtol=step)


def _counters_zero() -> bool:
    from chassis.core.layers import triton_ops

    torch.cuda.synchronize()
    return all(not counters.any() for counters in triton_ops._SPLIT_COUNTERS.values())


@pytest.mark.parametrize(
    ("shape", "dtype", "num_splits", "options"),
    [
        (QWEN3, torch.bfloat16, None, {}),  # the heuristic's split (asserted > 1)
        (QWEN3, torch.bfloat16, 1, {}),
        (QWEN3, torch.bfloat16, 16, {}),  # most splits empty
        (QWEN3, torch.float16, None, {}),
        (QWEN3, torch.float32, None, {}),
        (GPT_OSS, torch.bfloat16, None, dict(sliding_window=128, sinks=True)),
        (GEMMA2, torch.bfloat16, None, dict(sliding_window=256, logits_soft_cap=50.0)),
    ],
    ids=str,
)
def test_fused_decode_matches_separate_kernels_and_dense(
    shape, dtype: torch.dtype, num_splits: int | None, options: dict
) -> None:
    """A decode-only step with the K/V write and the split merge in the attention kernel:
    the cache bits of the write kernel (padding tokens, slot -1, write nothing), the output of
    the separate kernels within a rounding step, the dense answer; counters zero after."""
    num_heads, num_kv_heads, head_dim = shape
    batch = make_batch(
        FUSED_DECODES,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        device="cuda",
        num_pad_tokens=3,
    )
    options = dict(options)
    sinks = None
    if options.pop("sinks", False):
        gen = torch.Generator().manual_seed(0)
        sinks = (2 * torch.randn(num_heads, generator=gen)).to(dtype).cuda()
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    scale = head_dim**-0.5
    args = {**options, "sinks": sinks, "num_splits": num_splits}
    config = kernels.paged_attention(
        batch.query, batch.kv_cache.clone(), torch.empty_like(batch.query),
        **batch.kernel_args(scale), **args,
    )  # fmt: skip
    if num_splits is None:
        assert config.num_splits > 1, config
    separate, fused, separate_cache, fused_cache = _fused_and_separate(batch, scale, **args)
    torch.testing.assert_close(fused_cache, separate_cache, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(fused_cache, batch.expected_cache, atol=0, rtol=0, equal_nan=True)
    _assert_within_one_rounding(fused, separate)
    window, cap = options.get("sliding_window"), options.get("logits_soft_cap")
    expected = dense_attention(batch, scale, window, cap, sinks)
    tol = TOL[dtype]
    torch.testing.assert_close(fused.float().cpu(), expected, atol=tol, rtol=tol)
    assert _counters_zero()


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fused_decode_quantizes_as_the_write_kernel(fp8: torch.dtype) -> None:
    """An 8-bit cache at Qwen3's shape with the heuristic's split: the fused write stores the
    write kernel's bytes (scaled, saturated, rounded to nearest even)."""
    batch = make_batch(FUSED_DECODES, **QWEN3_BF16, num_pad_tokens=3)
    batch.key.mul_(300.0)  # some keys past e4m3's range after the scale
    batch.kv_cache = batch.kv_cache.to(fp8)
    args = dict(k_scale=0.5, v_scale=2.0)
    separate, fused, separate_cache, fused_cache = _fused_and_separate(batch, 128**-0.5, **args)
    assert torch.equal(fused_cache.view(torch.uint8), separate_cache.view(torch.uint8))
    _assert_within_one_rounding(fused, separate)


def test_fused_decode_launches_back_to_back_agree() -> None:
    """200 fused split launches queued without a sync, the new tokens' slots set to NaN
    before each (a queued kernel too), each taking tickets from the counters the one before
    left: every output the same bits, the counters zero after. A ticket left over, a merge
    that read a partial before its store landed, or a tile read before the write (NaN) would
    break some."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    batch = make_batch(FUSED_DECODES, **QWEN3_BF16)
    m = batch.metadata
    launch = dict(
        key=batch.key,
        value=batch.value,
        slot_mapping=m.slot_mapping,
        fuse_kv_write=True,
        fuse_combine=True,
        **batch.kernel_args(128**-0.5),
    )
    block_size = batch.kv_cache.shape[2]
    new_blocks, new_offsets = m.slot_mapping // block_size, m.slot_mapping % block_size
    outs = [torch.empty_like(batch.query) for _ in range(200)]
    configs = set()
    for out in outs:
        batch.kv_cache[new_blocks, :, new_offsets] = float("nan")
        configs.add(kernels.paged_attention(batch.query, batch.kv_cache, out, **launch))
    assert all(c.num_splits > 1 for c in configs), configs
    assert all(torch.equal(o, outs[0]) for o in outs)
    _check(outs[0], batch, 128**-0.5)
    assert _counters_zero()


def _append_padding_requests(batch, count: int):
    """``batch`` with ``count`` more requests as a CUDA graph's padding rows are: one token,
    ``seq_len`` 1, slot -1, block-table row 0 (its K/V must not be written)."""
    m = batch.metadata
    dev = batch.query.device
    n = m.num_actual_tokens
    batch.query = torch.cat([batch.query[:n], torch.randn_like(batch.query[:count])])
    batch.key = torch.cat([batch.key[:n], torch.randn_like(batch.key[:count])])
    batch.value = torch.cat([batch.value[:n], torch.randn_like(batch.value[:count])])
    qsl = torch.arange(n + count + 1, dtype=torch.int32)
    lens = torch.cat([m.seq_lens_cpu, torch.ones(count, dtype=torch.int32)])
    pad_table = torch.zeros(count, m.block_table.shape[1], dtype=torch.int32, device=dev)
    m.query_start_loc, m.query_start_loc_cpu = qsl.to(dev), qsl
    m.seq_lens, m.seq_lens_cpu = lens.to(dev), lens
    m.block_table = torch.cat([m.block_table, pad_table])
    m.slot_mapping = torch.cat(
        [m.slot_mapping[:n], torch.full((count,), -1, dtype=torch.int64, device=dev)]
    )
    m.num_reqs += count
    m.num_actual_tokens = n + count
    return batch


def test_fused_decode_cuda_graph_replays_with_new_metadata(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The backend built under CHASSIS_FUSED_DECODE_ATTENTION=1, a decode step with two
    padding requests (slot -1) captured and replayed on other lengths and blocks: each replay
    writes the new K/V (the cache the write kernel would leave), merges the splits and
    matches the dense answer."""
    monkeypatch.setenv("CHASSIS_FUSED_DECODE_ATTENTION", "1")
    backend = _backend(16, 8, 128)
    assert backend.fused_decode
    shape = dict(**QWEN3_BF16, num_blocks=200, max_blocks=130)
    a = _append_padding_requests(make_batch([(250, 1), (60, 1), (3, 1), (900, 1)], **shape), 2)
    b = _append_padding_requests(make_batch([(3, 1), (1900, 1), (60, 1), (10, 1)], **shape), 2)
    expected_a, expected_b = a.expected_cache.clone(), b.expected_cache.clone()
    static = (a.query, a.key, a.value, a.kv_cache, a.metadata)
    clean = a.kv_cache.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(*static)  # compile, allocate this stream's counters, warm up
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    a.kv_cache.copy_(clean)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = backend.forward(*static)
    a.kv_cache.copy_(clean)  # (capture runs nothing, but be sure)
    graph.replay()
    torch.cuda.synchronize()
    # padding rows wrote nothing: block 0 holds only what the batch put there
    torch.testing.assert_close(a.kv_cache, expected_a, atol=0, rtol=0, equal_nan=True)
    a.metadata.num_actual_tokens = a.metadata.num_actual_tokens - 2
    _check(out, a, backend.scale)

    for name in ("query", "key", "value", "kv_cache"):
        getattr(a, name).copy_(getattr(b, name))
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        getattr(a.metadata, name).copy_(getattr(b.metadata, name))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(a.kv_cache, expected_b, atol=0, rtol=0, equal_nan=True)
    b.metadata.num_actual_tokens -= 2
    _check(out, b, backend.scale)
    assert _counters_zero()
