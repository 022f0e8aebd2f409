"""The ``triton_paged`` backend's kernels against a dense float32 reference, on the CPU.

Triton kernels run on the CPU only under Triton's interpreter, which must be switched on
(``TRITON_INTERPRET=1``) before ``triton`` is first imported; in a whole-suite run something
has usually imported it already. So :func:`test_kernels_under_interpreter` re-runs this file in
a child pytest with the variable set (one child shared with the other Triton test files, see
``tests/triton_compile_check.py``), and the kernel tests run only there. To see them one by
one: ``TRITON_INTERPRET=1 python -m pytest tests/test_triton_attention.py``.

Shapes are tiny: the interpreter executes every program of the grid in numpy.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from paged_attention_cases import dense_attention, make_batch
from triton_compile_check import (
    TARGETS,
    compile_attention_variant,
    compile_kernel,
    in_interpreter,
    interpreter_parent,
    not_in_interpreter,
    run_kernel_tests,
)

#: (cached prefix length, query length): chunks over prefixes of several lengths, a prefill
#: from scratch over several query blocks, decodes (one over several KV tiles)
MIXED = [(5, 7), (0, 40), (13, 1), (0, 1), (60, 10), (16, 16), (33, 1)]
DECODES = [(0, 1), (3, 1), (17, 1), (70, 1), (8, 1)]
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
#: for a window of 8: prefills shorter and longer than it, chunks over a prefix that starts
#: inside it (3) and before it (12, 100: whole 64-position tiles before it are skipped),
#: decodes at its edge (context 8), one past it (9) and far past it (71: decode tiles skipped)
WINDOWED = [(0, 5), (0, 20), (3, 4), (12, 6), (7, 1), (8, 1), (70, 1), (100, 5)]
#: (sliding_window, logits_soft_cap): a window of 1 is the token itself; 1000 exceeds every
#: context (full attention); a cap of 0.5 squeezes every score into (-0.5, 0.5)
WINDOW_CAP = [(8, None), (None, 2.0), (8, 2.0), (1, None), (1000, 0.5)]


@interpreter_parent
def test_kernels_under_interpreter(request: pytest.FixtureRequest) -> None:
    output = run_kernel_tests(__file__, request)  # (skips where the interpreter cannot)
    assert "skipped" in output, output[-2000:]


def _backend(num_heads: int, num_kv_heads: int, head_dim: int, **options):
    from chassis.builtin_plugins.attention.triton_paged import TritonPagedAttention

    return TritonPagedAttention(num_heads, head_dim, num_kv_heads, head_dim**-0.5, **options)


def _assert_matches_dense(
    out: torch.Tensor,
    batch,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out`` is :func:`dense_attention`'s answer with these options, which is returned."""
    n = batch.metadata.num_actual_tokens
    expected = dense_attention(batch, scale, sliding_window, logits_soft_cap, sinks)
    torch.testing.assert_close(out[:n].float(), expected, atol=ATOL[out.dtype], rtol=0)
    return expected


def _windowed_batch(dtype: torch.dtype, seed: int):
    """:data:`WINDOWED` over blocks of 4 with GQA (4 heads of 16 over 2 KV heads) and 2
    padding tokens."""
    return make_batch(
        WINDOWED,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=dtype,
        num_pad_tokens=2,
        seed=seed,
    )


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_cache_skips_padding(dtype: torch.dtype) -> None:
    from chassis.builtin_plugins.attention.triton_paged_kernels import write_kv_cache

    batch = make_batch(
        MIXED[:4],
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=dtype,
        num_pad_tokens=3,
    )
    write_kv_cache(batch.key, batch.value, batch.kv_cache, batch.metadata.slot_mapping)
    # bit-exact, and every slot not named by slot_mapping (NaN-filled) untouched
    torch.testing.assert_close(batch.kv_cache, batch.expected_cache, atol=0, rtol=0, equal_nan=True)


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(2, 2, 16, 4), (4, 2, 32, 16), (6, 2, 16, 16)],  # GQA 1, 2 and a non-power-of-two 3
)
def test_backend_matches_dense_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    batch = make_batch(
        MIXED,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        num_pad_tokens=2,
    )
    backend = _backend(num_heads, num_kv_heads, head_dim)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    assert out.shape == batch.query.shape and out.dtype == dtype
    torch.testing.assert_close(batch.kv_cache, batch.expected_cache, atol=0, rtol=0, equal_nan=True)
    _assert_matches_dense(out, batch, backend.scale)


@in_interpreter
@pytest.mark.parametrize(
    ("specs", "num_splits"),
    # 16 (every combine lane used, most splits empty) on the cheap decodes only; 2 takes the
    # same split path as 3
    [(DECODES, 1), (DECODES, 3), (DECODES, 16), (MIXED[:5], 1), (MIXED[:5], 3)],
    ids=["decodes-1", "decodes-3", "decodes-16", "mixed-1", "mixed-3"],
)
def test_split_kv_gives_the_same_result(specs, num_splits: int) -> None:
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    batch = make_batch(
        specs,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=torch.float32,
        num_pad_tokens=1,
    )
    kernels.write_kv_cache(batch.key, batch.value, batch.kv_cache, batch.metadata.slot_mapping)
    out = torch.empty_like(batch.query)
    config = kernels.paged_attention(
        batch.query, batch.kv_cache, out, num_splits=num_splits, **batch.kernel_args(0.25)
    )
    assert config.num_splits == num_splits
    _assert_matches_dense(out, batch, 0.25)


@in_interpreter
@pytest.mark.parametrize(
    "tiles",
    [(16, 16, 1, 2, 1), (32, 64, 3, 4, 3), (64, 32, 2, 8, 2)],
    ids=["small", "split3", "wide"],
)
def test_explicit_launch_configs_give_the_same_result(tiles) -> None:
    """Tuning sweeps launch with configs of their own: any valid one computes the same."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    block_m, tile_n, num_splits, num_warps, num_stages = tiles
    batch = make_batch(
        MIXED[:5], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32
    )
    kernels.write_kv_cache(batch.key, batch.value, batch.kv_cache, batch.metadata.slot_mapping)
    out = torch.empty_like(batch.query)
    config = kernels.LaunchConfig(block_m, block_m // 2, tile_n, num_splits, num_warps, num_stages)
    args = batch.kernel_args(0.25)
    assert (
        kernels.paged_attention(batch.query, batch.kv_cache, out, config=config, **args) == config
    )
    _assert_matches_dense(out, batch, 0.25)
    bad = kernels.LaunchConfig(block_m, block_m, tile_n, num_splits, num_warps, num_stages)
    with pytest.raises(ValueError, match="block_q must be block_m // group"):
        kernels.paged_attention(batch.query, batch.kv_cache, out, config=bad, **args)


@in_interpreter
@pytest.mark.parametrize(
    "specs", [[(0, 23)], [(40, 1)], [(9, 5)]], ids=["prefill", "decode", "chunk"]
)
def test_single_request(specs) -> None:
    batch = make_batch(
        specs, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float16
    )
    backend = _backend(4, 2, 16)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    _assert_matches_dense(out, batch, backend.scale)


@in_interpreter
def test_head_dim_that_is_not_a_power_of_two() -> None:
    batch = make_batch(
        MIXED[:4],
        num_heads=4,
        num_kv_heads=2,
        head_dim=24,
        block_size=4,
        dtype=torch.float16,
        num_pad_tokens=1,
    )
    backend = _backend(4, 2, 24)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    torch.testing.assert_close(batch.kv_cache, batch.expected_cache, atol=0, rtol=0, equal_nan=True)
    _assert_matches_dense(out, batch, backend.scale)


@in_interpreter
def test_noncontiguous_views_of_a_fused_qkv_projection() -> None:
    """Models pass q/k/v as views of one ``[T, (Hq + 2 Hk) D]`` matmul output."""
    batch = make_batch(
        MIXED[:3], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32
    )
    t = batch.query.shape[0]
    qkv = torch.cat([batch.query.flatten(1), batch.key.flatten(1), batch.value.flatten(1)], 1)
    q, k, v = qkv.split([64, 32, 32], dim=1)
    backend = _backend(4, 2, 16)
    out = backend.forward(
        q.view(t, 4, 16), k.view(t, 2, 16), v.view(t, 2, 16), batch.kv_cache, batch.metadata
    )
    _assert_matches_dense(out, batch, backend.scale)


@in_interpreter
def test_matches_torch_paged_backend() -> None:
    torch_paged = pytest.importorskip("chassis.builtin_plugins.attention.torch_paged")
    for dtype in (torch.float32, torch.bfloat16):
        # finite junk in unowned slots: the reference's masked SDPA multiplies them by 0
        shape = dict(
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            block_size=4,
            dtype=dtype,
            num_pad_tokens=2,
            unwritten_fill=1e4,
        )
        batch, other = make_batch(MIXED, **shape), make_batch(MIXED, **shape)
        ours = _backend(4, 2, 16).forward(
            batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata
        )
        ref = torch_paged.TorchPagedAttention(4, 16, 2, 0.25).forward(
            other.query, other.key, other.value, other.kv_cache, other.metadata
        )
        n = batch.metadata.num_actual_tokens
        torch.testing.assert_close(ours[:n].float(), ref[:n].float(), atol=2 * ATOL[dtype], rtol=0)
        torch.testing.assert_close(batch.kv_cache, other.kv_cache, atol=0, rtol=0, equal_nan=True)


@in_interpreter
@pytest.mark.parametrize(
    ("async_scheduling", "fused"),
    [(False, False), (True, False), (False, True)],
    ids=["sync", "async", "fused-decode"],
)
def test_engine_with_triton_paged_matches_torch_paged(
    tiny_qwen3_dir, async_scheduling: bool, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole engine with the GPU's attention backend (its model-runner integration:
    metadata, chunked prefills beside decodes, KV writes through the slot mapping), greedy
    tokens equal to the reference backend's; also with async scheduling, and with
    ``CHASSIS_FUSED_DECODE_ATTENTION=1`` (decode steps' K/V written by the attention kernel)."""
    from chassis import LLM, SamplingParams

    if fused:
        monkeypatch.setenv("CHASSIS_FUSED_DECODE_ATTENTION", "1")

    prompts = [{"prompt_token_ids": [3 + i, 5, 7, 9 + i] * (i + 2)} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("torch_paged", "triton_paged"):
        llm = LLM(
            str(tiny_qwen3_dir),
            dtype="float32",
            max_model_len=64,
            block_size=4,
            num_kv_blocks=64,
            max_num_batched_tokens=16,  # the longer prompts prefill in chunks beside decodes
            skip_tokenizer_init=True,
            attention_backend=backend,
            async_scheduling=async_scheduling,
        )
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["triton_paged"] == tokens["torch_paged"]


@in_interpreter
@pytest.mark.parametrize(
    ("sliding_window", "soft_cap", "dtype"),
    # bfloat16 (float32 dots under the interpreter, as float32) with both options only
    [(*options, torch.float32) for options in WINDOW_CAP] + [(8, 2.0, torch.bfloat16)],
)
def test_sliding_window_and_soft_cap_match_dense(
    sliding_window: int | None, soft_cap: float | None, dtype: torch.dtype
) -> None:
    """Keys before the window (NaN-free but never to be weighted) and the capped scores, over
    a mixed batch with GQA; slots no request owns hold NaN, so a skipped tile read shows."""
    batch = _windowed_batch(dtype, seed=3)
    options = dict(sliding_window=sliding_window, logits_soft_cap=soft_cap)
    backend = _backend(4, 2, 16, **options)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    torch.testing.assert_close(batch.kv_cache, batch.expected_cache, atol=0, rtol=0, equal_nan=True)
    _assert_matches_dense(out, batch, backend.scale, sliding_window, soft_cap)
    if sliding_window == 8 or soft_cap is not None:  # the options change the answer
        n = batch.metadata.num_actual_tokens
        assert not torch.allclose(out[:n].float(), dense_attention(batch, backend.scale), atol=0.1)


@in_interpreter
@pytest.mark.parametrize("num_splits", [1, 3])  # (3 already leaves splits without a tile)
@pytest.mark.parametrize(("tile_n", "block_m"), [(16, 16), (32, 32)], ids=["t16", "t32"])
def test_window_skips_tiles_and_splits_what_is_left(
    num_splits: int, tile_n: int, block_m: int
) -> None:
    """Small tiles put whole tiles before the window of most query blocks (the loop starts
    past them) and the split-KV path divides only the tiles left; every config agrees with
    the dense reference, also with a soft cap."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    batch = make_batch(
        WINDOWED, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32
    )
    kernels.write_kv_cache(batch.key, batch.value, batch.kv_cache, batch.metadata.slot_mapping)
    out = torch.empty_like(batch.query)
    config = kernels.LaunchConfig(block_m, block_m // 2, tile_n, num_splits, 4, 2)
    kernels.paged_attention(
        batch.query,
        batch.kv_cache,
        out,
        config=config,
        sliding_window=9,
        logits_soft_cap=1.5,
        **batch.kernel_args(0.25),
    )
    _assert_matches_dense(out, batch, 0.25, 9, 1.5)


#: chunked local attention (Llama 4) with chunks of 8, over the windowed cases (chunks that
#: start inside a prefix, decodes at a chunk's first position and far on)
CHUNK_OPTIONS = [dict(), dict(sliding_window=5), dict(logits_soft_cap=2.0)]


@in_interpreter
@pytest.mark.parametrize("options", CHUNK_OPTIONS, ids=["plain", "window", "cap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_attention_matches_dense(options: dict, dtype: torch.dtype) -> None:
    """Keys before each query's chunk start are hidden (slots no request owns hold NaN, so a
    skipped tile read shows), also with a window or a soft cap beside the chunks."""
    batch = _windowed_batch(dtype, seed=4)
    backend = _backend(4, 2, 16, attention_chunk_size=8, **options)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    window, cap = options.get("sliding_window"), options.get("logits_soft_cap")
    n = batch.metadata.num_actual_tokens
    expected = dense_attention(batch, backend.scale, window, cap, attention_chunk_size=8)
    torch.testing.assert_close(out[:n].float(), expected, atol=ATOL[dtype], rtol=0)
    assert not torch.allclose(
        expected, dense_attention(batch, backend.scale, window, cap), atol=0.1
    )


@in_interpreter
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("tile_n", "block_m"), [(16, 16), (32, 32)], ids=["t16", "t32"])
def test_chunks_skip_tiles_and_split_what_is_left(
    num_splits: int, tile_n: int, block_m: int
) -> None:
    """Small tiles put whole tiles before the chunk start of most query blocks (the loop
    starts past them); every config, split or not, agrees with the dense reference."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    batch = make_batch(
        WINDOWED, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32
    )
    kernels.write_kv_cache(batch.key, batch.value, batch.kv_cache, batch.metadata.slot_mapping)
    out = torch.empty_like(batch.query)
    config = kernels.LaunchConfig(block_m, block_m // 2, tile_n, num_splits, 4, 2)
    kernels.paged_attention(
        batch.query,
        batch.kv_cache,
        out,
        config=config,
        attention_chunk_size=16,
        **batch.kernel_args(0.25),
    )
    n = batch.metadata.num_actual_tokens
    expected = dense_attention(batch, 0.25, attention_chunk_size=16)
    torch.testing.assert_close(out[:n], expected, atol=ATOL[torch.float32], rtol=0)


@in_interpreter
@pytest.mark.parametrize("num_splits", [1, 3])
def test_chunked_decodes_one_block_per_request(num_splits: int) -> None:
    """Decode-only steps (one query block per request, the kernel variant CUDA graphs
    capture) apply the chunk too, split or not, with sinks beside it."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    batch = make_batch(
        DECODES, num_heads=6, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32
    )
    kernels.write_kv_cache(batch.key, batch.value, batch.kv_cache, batch.metadata.slot_mapping)
    sinks = _sinks(6, torch.float32)
    out = torch.empty_like(batch.query)
    config = kernels.paged_attention(
        batch.query,
        batch.kv_cache,
        out,
        num_splits=num_splits,
        sinks=sinks,
        attention_chunk_size=8,
        **batch.kernel_args(0.25),
    )
    assert batch.metadata.max_query_len <= config.block_q  # ONE_BLOCK_PER_REQ
    n = batch.metadata.num_actual_tokens
    expected = dense_attention(batch, 0.25, sinks=sinks, attention_chunk_size=8)
    torch.testing.assert_close(out[:n], expected, atol=ATOL[torch.float32], rtol=0)
    assert not torch.allclose(expected, dense_attention(batch, 0.25, sinks=sinks), atol=0.1)


#: (sliding_window, logits_soft_cap) combined with attention sinks
SINK_OPTIONS = [(None, None), (8, None), (8, 2.0)]


def _sinks(num_heads: int, dtype: torch.dtype) -> torch.Tensor:
    return (2 * torch.randn(num_heads, generator=torch.Generator().manual_seed(2))).to(dtype)


@in_interpreter
@pytest.mark.parametrize(
    ("sliding_window", "soft_cap", "dtype"),
    # bfloat16 sinks (a parameter of the model dtype) with window and cap together only
    [(*options, torch.float32) for options in SINK_OPTIONS] + [(8, 2.0, torch.bfloat16)],
)
def test_attention_sinks_match_dense(
    sliding_window: int | None, soft_cap: float | None, dtype: torch.dtype
) -> None:
    """gpt-oss's per-head sink logits in every softmax denominator: the HAS_SINKS variant
    over prefills, chunks over cached prefixes and decodes with GQA (the sinks a parameter
    of the model dtype)."""
    batch = _windowed_batch(dtype, seed=4)
    sinks = _sinks(4, dtype)
    options = dict(sliding_window=sliding_window, logits_soft_cap=soft_cap, sinks=sinks)
    backend = _backend(4, 2, 16, **options)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    expected = _assert_matches_dense(out, batch, backend.scale, sliding_window, soft_cap, sinks)
    without = dense_attention(batch, backend.scale, sliding_window, soft_cap)
    assert not torch.allclose(expected, without, atol=0.1)


@in_interpreter
@pytest.mark.parametrize("num_splits", [1, 3])  # (3 already leaves splits without a tile)
@pytest.mark.parametrize("specs", [DECODES, WINDOWED], ids=["decodes", "windowed"])
def test_attention_sinks_count_once_over_kv_splits(num_splits: int, specs) -> None:
    """With the KV range split, only split 0 carries the sink: every split count gives the
    dense answer, with a window too (splits that see no key at all)."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    batch = make_batch(
        specs, num_heads=6, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32
    )
    kernels.write_kv_cache(batch.key, batch.value, batch.kv_cache, batch.metadata.slot_mapping)
    sinks = _sinks(6, torch.float32)
    for window in (None, 5):
        out = torch.empty_like(batch.query)
        config = kernels.paged_attention(
            batch.query,
            batch.kv_cache,
            out,
            num_splits=num_splits,
            sliding_window=window,
            sinks=sinks,
            **batch.kernel_args(0.25),
        )
        assert config.num_splits == num_splits
        _assert_matches_dense(out, batch, 0.25, window, None, sinks)


@in_interpreter
def test_empty_step_launches_nothing() -> None:
    batch = make_batch(
        [(3, 1)], num_heads=2, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32
    )
    m = batch.metadata
    m.num_reqs, m.num_actual_tokens = 0, 0
    empty_q = batch.query[:0]
    out = _backend(2, 2, 16).forward(empty_q, batch.key[:0], batch.value[:0], batch.kv_cache, m)
    assert out.shape == (0, 2, 16)


@in_interpreter
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_step_one_program_per_request_equals_the_searched_grid(num_splits: int) -> None:
    """A decode-like step runs one program per request (no search over query_start_loc); the
    same step through the general grid, chosen by a larger max_query_len bound, and the dense
    reference agree. Two- and three-token queries fit one block of the decode tile too."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    batch = make_batch(
        [(0, 1), (37, 1), (5, 2), (70, 1), (12, 3), (3, 1)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=torch.float32,
        num_pad_tokens=2,
    )
    kernels.write_kv_cache(batch.key, batch.value, batch.kv_cache, batch.metadata.slot_mapping)
    outs = []
    for max_query_len in (3, 40):  # decode tile: one block per request; then the general grid
        args = {**batch.kernel_args(0.25), "max_query_len": max_query_len}
        out = torch.empty_like(batch.query)
        config = kernels.paged_attention(
            batch.query, batch.kv_cache, out, num_splits=num_splits, **args
        )
        assert (max_query_len <= config.block_q) == (max_query_len == 3)
        _assert_matches_dense(out, batch, 0.25)
        outs.append(out[: batch.metadata.num_actual_tokens])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=0)


# -- fused decode: the KV write and the split-KV merge inside the attention kernel ----------

#: decodes over 1-5 KV tiles of 16 positions (the explicit configs below) or 1-3 of 32 (the
#: chosen one), new tokens at a block's first, middle and last slot, and 2 padding tokens
FUSED_DECODES = [(0, 1), (3, 1), (17, 1), (70, 1), (8, 1), (47, 1)]


@contextmanager
def _recording_launches() -> Iterator[list]:
    """The kernels ``triton_paged_kernels`` launches inside the block, in order."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    launched = []
    check = kernels.check_launchable

    def recording(kernel, tensor):
        launched.append(kernel)
        return check(kernel, tensor)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "check_launchable", recording)
        yield launched


def _copy_cache(cache: torch.Tensor) -> torch.Tensor:
    """A copy of ``cache``, its V plane aliasing its K plane again where ``cache``'s does."""
    from chassis.core.attention import alias_kv_planes

    return alias_kv_planes(cache[:, :1].clone()) if cache.stride(1) == 0 else cache.clone()


def _two_ways(batch, options: dict, cache=None, **launch):
    """The step by the write kernel + attention (+ combine), and by the fused attention
    kernel, each on its own copy of the batch's cache (``cache``: instead of it): both
    outputs, both caches and the kernels the fused launch ran."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    cache = batch.kv_cache if cache is None else cache
    m = batch.metadata
    args = {**batch.kernel_args(0.25), **options, **launch}
    new_kv = dict(key=batch.key, value=batch.value, slot_mapping=m.slot_mapping)
    results = []
    for fuse in (False, True):
        kv_cache = _copy_cache(cache)
        out = torch.empty_like(batch.query)
        with _recording_launches() as launched:
            kernels.paged_attention(
                batch.query, kv_cache, out, **new_kv, fuse_kv_write=fuse, fuse_combine=fuse, **args
            )
        results.append((out[: m.num_actual_tokens], kv_cache, launched))
    (ref, ref_cache, _), (out, fused_cache, launched) = results
    return ref, out, ref_cache, fused_cache, launched


def _counters_all_zero() -> bool:
    from chassis.core.layers import triton_ops

    return all(not counters.any() for counters in triton_ops._SPLIT_COUNTERS.values())


#: (name, num_heads, num_kv_heads, num_splits, tile_n, options): GQA groups 1-3; no split, 3,
#: 5 and 16 (most of them empty); windows, caps, sinks and chunks with the split; KV tiles of
#: 16 positions, or (None) the launcher's decode tiles of 32 (a group of 3 fills 15 of 16 rows,
#: which only the launcher's own config does)
FUSED_CASES = [
    ("gqa2-split1", 4, 2, 1, 16, {}),
    ("gqa2-split3", 4, 2, 3, 16, {}),
    ("gqa3-split16", 3, 1, 16, None, {}),
    ("gqa1-split3-window-cap", 2, 2, 3, 16, dict(sliding_window=5, logits_soft_cap=2.0)),
    ("gqa3-split3-sinks-chunks", 6, 2, 3, None, dict(sinks=True, attention_chunk_size=32)),
    ("gqa2-split5-window", 4, 2, 5, 16, dict(sliding_window=20)),
]


@in_interpreter
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "num_splits", "tile_n", "options"),
    [case[1:] for case in FUSED_CASES],
    ids=[case[0] for case in FUSED_CASES],
)
def test_fused_decode_equals_the_separate_kernels_bit_for_bit(
    num_heads: int,
    num_kv_heads: int,
    num_splits: int,
    tile_n: int | None,
    options: dict,
) -> None:
    """A decode-only step with the K/V write and the split merge inside the attention kernel
    (one launch) gives the same output bits as the write, attention and combine kernels, the
    same cache bits (padding rows, slot -1, write nothing; unowned slots stay NaN), and the
    dense answer; the ticket counters are zero afterwards."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    group = num_heads // num_kv_heads
    batch = make_batch(
        FUSED_DECODES,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        block_size=4,
        dtype=torch.float32,
        num_pad_tokens=2,
        seed=num_splits,
    )
    options = dict(options)
    sinks = _sinks(num_heads, torch.float32) if options.pop("sinks", False) else None
    if tile_n is None:
        launch: dict = dict(num_splits=num_splits)
    else:
        launch = dict(config=kernels.LaunchConfig(16, 16 // group, tile_n, num_splits, 4, 2))
    ref, out, ref_cache, fused_cache, launched = _two_ways(
        batch, {**options, "sinks": sinks}, **launch
    )
    assert launched == [kernels._paged_attention_kernel]
    assert torch.equal(out, ref)
    torch.testing.assert_close(fused_cache, ref_cache, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(fused_cache, batch.expected_cache, atol=0, rtol=0, equal_nan=True)
    window, cap = options.get("sliding_window"), options.get("logits_soft_cap")
    chunk = options.get("attention_chunk_size")
    expected = dense_attention(batch, 0.25, window, cap, sinks, attention_chunk_size=chunk)
    torch.testing.assert_close(out, expected, atol=ATOL[torch.float32], rtol=0)
    assert _counters_all_zero()


@in_interpreter
def test_fused_decode_in_bfloat16_and_again_on_the_same_counters() -> None:
    """A bfloat16 model with the launcher's decode tiles and 3 splits: bit-equal to the
    separate kernels; three fused launches in a row (each starting from the counters the
    last one left) give the same bits."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    batch = make_batch(
        FUSED_DECODES, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.bfloat16
    )
    ref, out, ref_cache, fused_cache, launched = _two_ways(batch, {}, num_splits=3)
    assert launched == [kernels._paged_attention_kernel]
    assert torch.equal(out, ref)
    torch.testing.assert_close(fused_cache, ref_cache, atol=0, rtol=0, equal_nan=True)
    _assert_matches_dense(out, batch, 0.25)
    m = batch.metadata
    for _ in range(2):
        again = torch.empty_like(batch.query)
        kernels.paged_attention(
            batch.query,
            fused_cache,
            again,
            num_splits=3,
            key=batch.key,
            value=batch.value,
            slot_mapping=m.slot_mapping,
            fuse_kv_write=True,
            fuse_combine=True,
            **batch.kernel_args(0.25),
        )
        assert torch.equal(again[: m.num_actual_tokens], out)
        assert _counters_all_zero()


@in_interpreter
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fused_decode_write_quantizes_as_the_write_kernel(fp8: torch.dtype) -> None:
    """An 8-bit cache: the attention kernel's write stores the bytes the write kernel stores
    (``k / k_scale``, saturated, rounded to nearest even; values up to 8x the range saturate)
    and the outputs are the same bits."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    batch = make_batch(
        FUSED_DECODES,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=torch.bfloat16,
        num_pad_tokens=2,
    )
    batch.key.mul_(300.0 if fp8 == torch.float8_e4m3fn else 4e4)  # some past the range
    cache = batch.kv_cache.to(fp8)
    scales = dict(k_scale=0.5, v_scale=2.0)
    ref, out, ref_cache, fused_cache, launched = _two_ways(batch, scales, cache=cache, num_splits=3)
    assert launched == [kernels._paged_attention_kernel]
    assert torch.equal(fused_cache.view(torch.uint8), ref_cache.view(torch.uint8))
    assert not torch.equal(fused_cache.view(torch.uint8), cache.view(torch.uint8))  # written
    assert torch.equal(out, ref)


@in_interpreter
def test_fused_merge_of_a_mixed_step_with_the_write_kernel() -> None:
    """A mixed step (prefill chunks beside decodes) never fuses the write: the write kernel
    runs first; a forced split still merges in the attention kernel, over query blocks of
    many tokens (the general grid), to the same bits as the combine kernel."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    batch = make_batch(
        MIXED[:5],
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=torch.float32,
        num_pad_tokens=1,
    )
    ref, out, ref_cache, fused_cache, launched = _two_ways(batch, {}, num_splits=3)
    assert launched == [kernels._write_kv_kernel, kernels._paged_attention_kernel]
    assert torch.equal(out, ref)
    torch.testing.assert_close(fused_cache, ref_cache, atol=0, rtol=0, equal_nan=True)
    _assert_matches_dense(out, batch, 0.25)
    assert _counters_all_zero()


@in_interpreter
def test_fused_decode_falls_back_where_the_write_is_unsafe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kv head's query group spread over two head programs (DeepSeek's wide heads do it)
    and a V plane aliasing the K plane (MLA's latent cache) keep the write kernel; a grid
    with more (query block, head program) pairs than counters keeps the combine kernel. Each
    gives the separate kernels' bits."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels
    from chassis.core.attention import alias_kv_planes

    shape = dict(num_kv_heads=1, head_dim=16, block_size=4, dtype=torch.float32)
    batch = make_batch(FUSED_DECODES[:4], num_heads=4, **shape)
    spread = kernels.LaunchConfig(16, 8, 16, 3, 4, 2, heads_per_program=2)
    ref, out, _, _, launched = _two_ways(batch, {}, config=spread)
    assert launched == [kernels._write_kv_kernel, kernels._paged_attention_kernel]
    assert torch.equal(out, ref)

    batch.value = batch.key  # MLA passes the latent as both
    aliased = alias_kv_planes(batch.kv_cache[:, :1].clone())
    ref, out, ref_cache, fused_cache, launched = _two_ways(batch, {}, cache=aliased, num_splits=3)
    assert fused_cache.stride(1) == 0
    assert launched == [kernels._write_kv_kernel, kernels._paged_attention_kernel]
    assert torch.equal(out, ref)
    assert torch.equal(fused_cache.nan_to_num(), ref_cache.nan_to_num())

    monkeypatch.setattr(kernels, "NUM_SPLIT_COUNTERS", 3)  # 4 requests x 1 kv head
    batch = make_batch(FUSED_DECODES[:4], num_heads=4, **shape)
    ref, out, _, _, launched = _two_ways(batch, {}, num_splits=3)
    assert launched == [kernels._paged_attention_kernel, kernels._combine_kernel]
    assert torch.equal(out, ref)


@in_interpreter
def test_backend_fuses_decode_steps_under_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CHASSIS_FUSED_DECODE_ATTENTION=1``, read when a backend is built: its decode steps
    launch the attention kernel alone, its mixed steps the write kernel first; the same
    results either way. Unset (or another value): the write kernel every step."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    monkeypatch.setenv("CHASSIS_FUSED_DECODE_ATTENTION", "1")
    fused = _backend(4, 2, 16)
    monkeypatch.setenv("CHASSIS_FUSED_DECODE_ATTENTION", "true")
    assert not _backend(4, 2, 16).fused_decode
    monkeypatch.delenv("CHASSIS_FUSED_DECODE_ATTENTION")
    plain = _backend(4, 2, 16)
    assert fused.fused_decode and not plain.fused_decode
    shape = dict(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float16)
    write, attention = kernels._write_kv_kernel, kernels._paged_attention_kernel
    for specs, backend, launches in (
        (FUSED_DECODES, fused, [attention]),
        (FUSED_DECODES, plain, [write, attention]),
        (MIXED[:4], fused, [write, attention]),
    ):
        batch = make_batch(specs, num_pad_tokens=2, **shape)
        with _recording_launches() as launched:
            out = backend.forward(
                batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata
            )
        assert launched == launches
        torch.testing.assert_close(
            batch.kv_cache, batch.expected_cache, atol=0, rtol=0, equal_nan=True
        )
        _assert_matches_dense(out, batch, backend.scale)


def test_fused_write_blocker_names_each_reason() -> None:
    pytest.importorskip("triton")
    from chassis.builtin_plugins.attention.triton_paged_kernels import fused_kv_write_blocker
    from chassis.core.attention import alias_kv_planes

    cache = torch.zeros(2, 2, 4, 1, 16)
    common = dict(group=4, heads_per_program=4, max_query_len=1)
    assert fused_kv_write_blocker(kv_cache=cache, **common) is None
    blocker = fused_kv_write_blocker
    assert "decode-only" in blocker(kv_cache=cache, **{**common, "max_query_len": 2})
    assert "spread over programs" in blocker(kv_cache=cache, **{**common, "heads_per_program": 2})
    assert "aliases" in blocker(kv_cache=alias_kv_planes(cache[:, :1]), **common)


@in_interpreter
def test_launch_config_groups_heads_and_tiles() -> None:
    from chassis.builtin_plugins.attention.triton_paged_kernels import choose_launch_config

    cpu = torch.device("cpu")
    common = dict(num_tokens=8, num_reqs=8, max_seq_len=4000, device=cpu)
    decode = choose_launch_config(
        num_heads=16, num_kv_heads=8, head_dim=128, max_query_len=1, **common
    )
    assert (decode.block_m, decode.block_q, decode.num_splits) == (16, 8, 1)
    wide = choose_launch_config(
        num_heads=32, num_kv_heads=1, head_dim=64, max_query_len=1, **common
    )
    assert (wide.block_m, wide.block_q) == (32, 1)  # a group never straddles programs
    prefill = choose_launch_config(
        num_heads=9, num_kv_heads=3, head_dim=64, max_query_len=500, **common
    )
    assert (prefill.block_m, prefill.block_q, prefill.tile_n) == (64, 21, 64)
    with pytest.raises(ValueError, match="num_splits"):
        choose_launch_config(
            num_heads=2, num_kv_heads=2, head_dim=16, max_query_len=1, num_splits=17, **common
        )


def test_split_count_on_a_gpu_follows_its_idle_multiprocessors(monkeypatch) -> None:
    """Decode-like steps split the KV range until about two programs per multiprocessor
    exist (132 on an H200), never past 16 splits or useful tile counts; a step without
    requests (nothing to launch) must not divide by zero."""
    pytest.importorskip("triton")
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    monkeypatch.setattr(kernels, "_multiprocessor_count", lambda device: 132)
    gpu = torch.device("cuda")  # only its type is read

    def splits(num_reqs: int, max_seq_len: int) -> int:
        return kernels.choose_launch_config(
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
            num_tokens=num_reqs,
            num_reqs=num_reqs,
            max_query_len=1,
            max_seq_len=max_seq_len,
            device=gpu,
        ).num_splits

    assert splits(1, 4096) == 16  # 8 programs: 264 wanted
    assert splits(8, 4096) == 5  # 64 programs
    assert splits(256, 4096) == 1  # 2048 programs fill the GPU
    assert splits(1, 100) == 1  # a context of 4 tiles is not worth splitting
    assert splits(0, 4096) == 16


@not_in_interpreter
def test_cpu_tensors_without_interpreter_are_refused() -> None:
    pytest.importorskip("triton")
    batch = make_batch(
        [(3, 2)], num_heads=2, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32
    )
    backend = _backend(2, 2, 16)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)


def test_forward_validates_shapes_and_dtypes() -> None:
    pytest.importorskip("triton")
    batch = make_batch(
        [(3, 2)], num_heads=2, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32
    )
    backend = _backend(4, 2, 16)
    with pytest.raises(ValueError, match="query must be"):
        backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    backend = _backend(2, 2, 16)
    with pytest.raises(ValueError, match="computes in"):
        backend.forward(
            batch.query.double(), batch.key, batch.value, batch.kv_cache, batch.metadata
        )


def test_sinks_of_the_wrong_shape_are_refused() -> None:
    pytest.importorskip("triton")
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    batch = make_batch(
        [(3, 2)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32
    )
    out = torch.empty_like(batch.query)
    with pytest.raises(ValueError, match=r"sinks must be a float \[4\] tensor"):
        kernels.paged_attention(
            batch.query, batch.kv_cache, out, sinks=torch.zeros(2), **batch.kernel_args(0.25)
        )


@not_in_interpreter
@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t[0]}-{t[1]}")
def test_kernels_compile_for_gpu_targets(target) -> None:
    """Every kernel variant the launcher picks compiles to Hopper / MI300 machine code."""
    pytest.importorskip("triton")
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    variants = [  # (group, head_dim, block_m, tile_n, splits, fp32, warps, aligned)
        (2, 128, 16, 32, 1, False, 4, True),  # Qwen3 decode
        (2, 128, 16, 32, 4, False, 4, True),  # Qwen3 split-KV decode
        (2, 128, 64, 64, 1, False, 8, True),  # Qwen3 prefill
        (3, 64, 64, 64, 1, False, 4, True),  # SmolLM2 prefill, non-power-of-two group
        (2, 128, 64, 64, 1, True, 8, True),  # float32 model
        (2, 128, 16, 32, 1, False, 4, False),  # decode with strides not divisible by 16
        (2, 128, 64, 64, 1, False, 8, False),  # prefill likewise
    ]
    options = [dict(sliding_window=False, soft_cap=False)] * len(variants)
    # Gemma-2-like layers (GQA 2, head_dim 256; window and cap, or the cap alone) and a
    # Mistral-like windowed decode with the KV split
    variants += [
        (2, 256, 16, 32, 1, False, 4, True),
        (2, 256, 16, 32, 4, False, 4, True),
        (2, 256, 64, 64, 1, False, 8, True),
        (2, 256, 64, 64, 1, True, 8, True),
        (4, 128, 16, 32, 4, False, 4, True),
    ]
    options += [dict(sliding_window=True, soft_cap=True)] * 4
    options += [dict(sliding_window=True, soft_cap=False)]
    variants.append((2, 256, 64, 64, 1, False, 8, True))
    options.append(dict(sliding_window=False, soft_cap=True))
    # gpt-oss-like layers (GQA 8, head_dim 64, attention sinks; every other one windowed):
    # decode, split-KV decode (only split 0 holds the sink), prefill, float32
    variants += [
        (8, 64, 16, 32, 1, False, 4, True),
        (8, 64, 16, 32, 4, False, 4, True),
        (8, 64, 64, 64, 1, False, 4, True),
        (8, 64, 64, 64, 1, True, 4, True),
    ]
    options += [
        dict(sliding_window=True, soft_cap=False, sinks=True),
        dict(sliding_window=False, soft_cap=False, sinks=True),
        dict(sliding_window=True, soft_cap=False, sinks=True),
        dict(sliding_window=False, soft_cap=False, sinks=True),
    ]
    # CHASSIS_FUSED_DECODE_ATTENTION=1: Qwen3 decodes with the K/V write in the kernel, split
    # or not (the merge in the kernel too); a forced split of a prefill merged in the kernel;
    # gpt-oss's windowed decode with sinks; float32 (the GPU engine tests' tiny models)
    fused = dict(sliding_window=False, soft_cap=False, fused_write=True)
    variants += [
        (2, 128, 16, 32, 1, False, 4, True),
        (2, 128, 16, 32, 4, False, 4, True),
        (2, 128, 64, 64, 4, False, 8, True),
        (8, 64, 16, 32, 4, False, 4, True),
        (2, 128, 16, 32, 4, True, 4, True),
    ]
    options += [
        fused,
        {**fused, "fused_combine": True},
        dict(sliding_window=False, soft_cap=False, fused_combine=True),
        dict(sliding_window=True, soft_cap=False, sinks=True, fused_write=True, fused_combine=True),
        {**fused, "fused_combine": True},
    ]
    compiled = []
    for variant, option in zip(variants, options, strict=True):
        group, head_dim, block_m, tile_n, splits, fp32, warps, aligned = variant
        compiled.append(
            compile_attention_variant(
                target,
                group=group,
                head_dim=head_dim,
                block_m=block_m,
                tile_n=tile_n,
                split=splits > 1,
                fp32=fp32,
                num_warps=warps,
                aligned=aligned,
                **option,
            )
        )
    if target[0] == "cuda":
        _check_fused_ptx(compiled[-4].asm["ptx"])  # Qwen3's split decode, both fused
    scratch = {n: "*fp32" for n in ("part_acc_ptr", "part_max_ptr", "part_sum_ptr")}
    compile_kernel(
        kernels._combine_kernel,
        target,
        dict(NUM_HEADS=16, HEAD_DIM=128, DIM_PAD=128, SPLITS_PAD=16),
        pointer_types={**scratch, "query_start_loc_ptr": "*i32"},
    )
    compile_kernel(
        kernels._write_kv_kernel,
        target,
        dict(NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_PAD=8, DIM_PAD=128, BLOCK_SIZE=16),
        pointer_types={"slot_mapping_ptr": "*i64"},
    )


def _check_fused_ptx(ptx: str) -> None:
    """The fused decode variant's PTX: the K/V stores, then a CTA barrier, then the first
    pipelined KV tile loads (``cp.async``) that read the slot back; the ticket is a GPU-scope
    acquire-release atomic and the merge reads the partials from L2 (``ld.global.cg``)."""
    first_tile_load = ptx.index("cp.async")
    before = ptx[:first_tile_load]
    last_store = before.rindex("st.global")
    assert "bar.sync" in before[last_store:], "no barrier between the K/V write and its read"
    assert "atom.global.gpu.acq_rel.add" in ptx
    assert "ld.global.cg" in ptx
