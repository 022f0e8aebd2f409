"""The reference backend against dense causal attention computed from whole K/V sequences."""

from __future__ import annotations

import pytest
import torch
from fixtures_models import allocate_block_tables, make_attention_metadata
from paged_attention_cases import dense_attention, make_batch

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention, write_kv_cache
from chassis.core.attention import kv_cache_shape
from chassis.core.layers.attention import Attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16
SCALE = HEAD_DIM**-0.5

#: (query_len, seq_len): fresh prefills, prefills over a cached prefix, decodes
MIXED_BATCH = [(5, 5), (1, 7), (3, 11), (1, 1), (6, 20), (1, 33), (17, 17), (1, 16), (2, 40)]


def dense_reference(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """Float64 causal attention of ``query [Q, H, D]`` (the last Q of ``seq_len`` tokens)."""
    query_len = query.shape[0]
    groups = NUM_HEADS // NUM_KV_HEADS
    k = keys.double().repeat_interleave(groups, dim=1)  # [L, H, D]
    v = values.double().repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * SCALE
    q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    allowed = torch.arange(seq_len)[None, :] <= q_pos
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_batch(
    batch: list[tuple[int, int]],
    block_size: int,
    dtype: torch.dtype,
    num_padding_tokens: int = 0,
    seed: int = 0,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [s for _, s in batch]
    query_lens = [q for q, _ in batch]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 5
    tables = allocate_block_tables(seq_lens, block_size, num_blocks, gen)
    num_actual = sum(query_lens)
    metadata = make_attention_metadata(
        query_lens,
        seq_lens,
        tables,
        block_size,
        num_tokens=num_actual + num_padding_tokens,
        pad_block_id=10**6,  # garbage past each request's blocks must be ignored
    )
    sentinel = 123.0
    kv_cache = torch.full(
        kv_cache_shape(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM), sentinel, dtype=dtype
    )

    full_k = [torch.randn(s, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for s in seq_lens]
    full_v = [torch.randn(s, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for s in seq_lens]
    # The cached prefix of each request is already in the cache before the step.
    for table, (q_len, s_len), k, v in zip(tables, batch, full_k, full_v, strict=True):
        prefix = s_len - q_len
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(prefix)],
            dtype=torch.int64,
        )
        write_kv_cache(kv_cache, k[:prefix], v[:prefix], slots)

    total = num_actual + num_padding_tokens
    query = torch.randn(total, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    pad = torch.randn(num_padding_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    key = torch.cat([*(k[s - q :] for k, (q, s) in zip(full_k, batch, strict=True)), pad])
    value = torch.cat([*(v[s - q :] for v, (q, s) in zip(full_v, batch, strict=True)), pad])

    out = TorchPagedAttention(NUM_HEADS, HEAD_DIM, NUM_KV_HEADS, SCALE).forward(
        query, key, value, kv_cache, metadata
    )

    assert out.shape == query.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    start = 0
    for i, (q_len, s_len) in enumerate(batch):
        expected = dense_reference(query[start : start + q_len], full_k[i], full_v[i], s_len)
        torch.testing.assert_close(
            out[start : start + q_len].double(),
            expected,
            atol=tol,
            rtol=tol,
            msg=lambda m, i=i: f"request {i} {batch[i]}: {m}",
        )
        start += q_len

    # Every context token's K/V is now in the cache at its slot; no other slot was touched.
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for table, s_len, k, v in zip(tables, seq_lens, full_k, full_v, strict=True):
        for pos in range(s_len):
            block, offset = table[pos // block_size], pos % block_size
            assert torch.equal(kv_cache[block, 0, offset], k[pos])
            assert torch.equal(kv_cache[block, 1, offset], v[pos])
            written[block, offset] = True
    untouched = kv_cache.transpose(1, 2)[~written]  # [n, 2, KV, D]
    assert bool((untouched == sentinel).all()), "a padding or foreign slot was written"


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_matches_dense_attention(block_size: int, dtype: torch.dtype) -> None:
    run_batch(MIXED_BATCH, block_size, dtype, num_padding_tokens=3)


@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_only_batch(block_size: int) -> None:
    run_batch([(1, s) for s in (1, 2, 5, 16, 17, 31, 64)], block_size, torch.float32, seed=1)


def test_single_prefill_over_cached_prefix() -> None:
    run_batch([(9, 30)], 4, torch.float32, seed=2)


def test_output_keeps_query_dtype_with_float32_cache() -> None:
    """A bf16 query over a float32 cache: K/V are stored in the cache's dtype."""
    gen = torch.Generator().manual_seed(3)
    metadata = make_attention_metadata([4], [4], [[2]], 4)
    kv_cache = torch.zeros(kv_cache_shape(3, 4, NUM_KV_HEADS, HEAD_DIM))
    q = torch.randn(4, NUM_HEADS, HEAD_DIM, generator=gen).bfloat16()
    k = torch.randn(4, NUM_KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    v = torch.randn(4, NUM_KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    out = TorchPagedAttention(NUM_HEADS, HEAD_DIM, NUM_KV_HEADS, SCALE).forward(
        q, k, v, kv_cache, metadata
    )
    assert out.dtype == torch.bfloat16
    assert torch.equal(kv_cache[2, 0], k.float())
    torch.testing.assert_close(out.double(), dense_reference(q, k, v, 4), atol=2e-2, rtol=2e-2)


def test_rejects_heads_not_multiple_of_kv_heads() -> None:
    with pytest.raises(ValueError, match="multiple"):
        TorchPagedAttention(6, HEAD_DIM, 4, SCALE)


#: (cached prefix, query length): prefills shorter and longer than the window, chunks over a
#: cached prefix that starts before / inside the window, decodes at and past the window edge
WINDOW_BATCH = [(0, 5), (0, 19), (6, 1), (7, 1), (30, 1), (9, 4), (22, 6), (0, 1), (3, 12)]


def _window_batch(dtype: torch.dtype, seed: int):
    """:data:`WINDOW_BATCH` over blocks of 4, with GQA and 2 padding tokens."""
    return make_batch(
        WINDOW_BATCH,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=4,
        dtype=dtype,
        num_pad_tokens=2,
        seed=seed,
        # SDPA's masks add -inf, which leaves NaN in place: the reference backend gathers
        # whole blocks, so unowned slots hold a large finite value (weight on it would show)
        unwritten_fill=60.0,
    )


def _check_options_against_dense(batch, dtype: torch.dtype, **options) -> torch.Tensor:
    """The backend with ``options`` (``sliding_window``, ``logits_soft_cap``, ``sinks``) over
    ``batch`` gives :func:`dense_attention`'s answer, which is returned."""
    backend = TorchPagedAttention(NUM_HEADS, HEAD_DIM, NUM_KV_HEADS, SCALE, **options)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    n = batch.metadata.num_actual_tokens
    expected = dense_attention(
        batch,
        SCALE,
        options.get("sliding_window"),
        options.get("logits_soft_cap"),
        options.get("sinks"),
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:n].float(), expected, atol=tol, rtol=tol)
    return expected


@pytest.mark.parametrize(
    ("sliding_window", "soft_cap"), [(7, None), (None, 2.0), (7, 2.0), (1, None), (100, 0.5)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_and_soft_cap_match_dense_attention(
    sliding_window: int | None, soft_cap: float | None, dtype: torch.dtype
) -> None:
    """A window of 1 attends to the token itself only; a window longer than every context is
    full attention. The cap of 0.5 squeezes every score into (-0.5, 0.5)."""
    batch = _window_batch(dtype, seed=4)
    options = dict(sliding_window=sliding_window, logits_soft_cap=soft_cap)
    expected = _check_options_against_dense(batch, dtype, **options)
    full = dense_attention(batch, SCALE)
    if sliding_window == 7 or soft_cap is not None:  # the options change the answer
        assert not torch.allclose(expected, full, atol=1e-3)


def test_rejects_bad_window_and_cap() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        TorchPagedAttention(NUM_HEADS, HEAD_DIM, NUM_KV_HEADS, SCALE, sliding_window=0)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        TorchPagedAttention(NUM_HEADS, HEAD_DIM, NUM_KV_HEADS, SCALE, logits_soft_cap=0.0)


def test_attention_layer_refuses_backend_without_sliding_window() -> None:
    """A model layer with a window never silently runs full attention."""

    class FullOnly(TorchPagedAttention):
        supports_sliding_window = False

    with pytest.raises(ValueError, match="FullOnly does not support sliding-window"):
        Attention(NUM_HEADS, HEAD_DIM, NUM_KV_HEADS, SCALE, 3, FullOnly, sliding_window=4)
    layer = Attention(NUM_HEADS, HEAD_DIM, NUM_KV_HEADS, SCALE, 3, FullOnly)
    assert layer.backend.sliding_window is None


#: (sliding_window, logits_soft_cap) combined with attention sinks
SINK_OPTIONS = [(None, None), (7, None), (7, 2.0), (1, None)]


@pytest.mark.parametrize(("sliding_window", "soft_cap"), SINK_OPTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_sinks_match_dense_attention(
    sliding_window: int | None, soft_cap: float | None, dtype: torch.dtype
) -> None:
    """Per-head sink logits (gpt-oss) in every softmax denominator, over fresh prefills,
    chunks over cached prefixes and decodes, with GQA, with and without a window and a cap;
    the sinks are a bfloat16 parameter in the bfloat16 case (read as float32)."""
    batch = _window_batch(dtype, seed=6)
    sinks = (2 * torch.randn(NUM_HEADS, generator=torch.Generator().manual_seed(1))).to(dtype)
    options = dict(sliding_window=sliding_window, logits_soft_cap=soft_cap, sinks=sinks)
    expected = _check_options_against_dense(batch, dtype, **options)
    # the sinks take probability mass: the answer differs from attention without them
    assert not torch.allclose(expected, dense_attention(batch, SCALE, sliding_window, soft_cap))


def test_attention_sinks_are_read_at_every_call() -> None:
    """The backend keeps the model's parameter, which the weights fill after construction;
    a sink of -inf is no sink, a huge one takes all the mass (output 0)."""
    batch = make_batch(
        [(0, 6), (5, 1), (3, 3)],
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=4,
        dtype=torch.float32,
        unwritten_fill=60.0,
    )
    sinks = torch.nn.Parameter(torch.empty(NUM_HEADS), requires_grad=False)
    backend = TorchPagedAttention(NUM_HEADS, HEAD_DIM, NUM_KV_HEADS, SCALE, sinks=sinks)
    n = batch.metadata.num_actual_tokens

    def run() -> torch.Tensor:
        m = batch.metadata
        return backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, m)[:n]

    sinks.data.fill_(float("-inf"))
    torch.testing.assert_close(run(), dense_attention(batch, SCALE), atol=1e-5, rtol=1e-5)
    sinks.data.fill_(1e4)
    assert run().abs().max() < 1e-6
    sinks.data.copy_(torch.linspace(-2, 2, NUM_HEADS))
    expected = dense_attention(batch, SCALE, sinks=sinks.data)
    torch.testing.assert_close(run(), expected, atol=1e-5, rtol=1e-5)


def test_attention_layer_refuses_backend_without_sinks_and_bad_shapes() -> None:
    class NoSinks(TorchPagedAttention):
        supports_attention_sinks = False

    sinks = torch.zeros(NUM_HEADS)
    with pytest.raises(ValueError, match="NoSinks does not support attention sinks"):
        Attention(NUM_HEADS, HEAD_DIM, NUM_KV_HEADS, SCALE, 0, NoSinks, sinks=sinks)
    layer = Attention(NUM_HEADS, HEAD_DIM, NUM_KV_HEADS, SCALE, 0, TorchPagedAttention, sinks=sinks)
    assert layer.backend.sinks is sinks and "sinks" in repr(layer)
    assert Attention(NUM_HEADS, HEAD_DIM, NUM_KV_HEADS, SCALE, 0, NoSinks).backend.sinks is None
    with pytest.raises(ValueError, match=r"sinks must be a \[num_heads\] = \[6\] tensor"):
        TorchPagedAttention(NUM_HEADS, HEAD_DIM, NUM_KV_HEADS, SCALE, sinks=torch.zeros(2))
