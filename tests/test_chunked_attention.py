"""Chunked local attention (``attention_chunk_size``, Llama 4) in ``torch_paged`` and
``cpu_paged`` against the dense reference; ``triton_paged``'s runs under the interpreter in
tests/test_triton_attention.py. The attention layer's refusal of a backend without it."""

from __future__ import annotations

import pytest
import torch
from paged_attention_cases import dense_attention, make_batch

from chassis.builtin_plugins.attention.cpu_paged import CpuPagedAttention
from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.core.layers.attention import Attention

#: for chunks of 8: prefills of less than a chunk, of several chunks (40), chunks over a
#: prefix ending inside a chunk (3, 12) and on a chunk boundary (16), decodes at a chunk's
#: first position (context 9: position 8), its last (16) and far on (71)
CHUNKED = [(0, 5), (0, 40), (3, 4), (12, 6), (16, 3), (8, 1), (15, 1), (70, 1), (100, 20)]
BACKENDS = {"torch_paged": TorchPagedAttention, "cpu_paged": CpuPagedAttention}


def _batch(dtype: torch.dtype, block_size: int, seed: int = 3):
    # finite junk in slots no request owns (the torch paths gather whole blocks and mask)
    return make_batch(
        CHUNKED,
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        block_size=block_size,
        dtype=dtype,
        num_pad_tokens=2,
        seed=seed,
        unwritten_fill=1e4,
    )


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}


@pytest.mark.parametrize("backend_name", sorted(BACKENDS))
@pytest.mark.parametrize(
    "options",
    [dict(), dict(sliding_window=5), dict(logits_soft_cap=2.0), dict(sinks=True)],
    ids=["plain", "window", "cap", "sinks"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_attention_matches_dense_reference(backend_name, options, dtype, block_size):
    """Each query sees only its own chunk, also combined with a window, a soft cap or sinks;
    the cache write is unchanged."""
    chunk = 8
    options = dict(options)
    sinks = None
    if options.pop("sinks", False):
        sinks = options["sinks"] = torch.linspace(-1.0, 1.0, 6)
    backend = BACKENDS[backend_name](6, 16, 2, 0.25, attention_chunk_size=chunk, **options)
    b = _batch(dtype, block_size)
    out = backend.forward(b.query, b.key, b.value, b.kv_cache, b.metadata)
    n = b.metadata.num_actual_tokens
    torch.testing.assert_close(b.kv_cache, b.expected_cache, rtol=0, atol=0)
    window, cap = options.get("sliding_window"), options.get("logits_soft_cap")
    expected = dense_attention(b, 0.25, window, cap, sinks, attention_chunk_size=chunk)
    torch.testing.assert_close(out[:n].float(), expected, **_tolerance(dtype))
    # the chunks change the answer (so the test would see them ignored)
    unchunked = dense_attention(b, 0.25, window, cap, sinks)
    assert not torch.allclose(expected, unchunked, atol=0.1)


def test_cpu_paged_chunked_and_full_layers_share_a_step():
    """Llama 4's layer mix on one step's metadata: chunked and full layers alternate, each
    gets its own answer."""
    b = _batch(torch.float32, 4, seed=9)
    full = dense_attention(b, 0.25)
    chunked = dense_attention(b, 0.25, attention_chunk_size=8)
    n = b.metadata.num_actual_tokens
    for chunk, expected in ((8, chunked), (None, full), (8, chunked), (None, full)):
        cache = b.expected_cache.clone()
        cache[b.metadata.slot_mapping[:n] // 4, :, b.metadata.slot_mapping[:n] % 4] = 1e4
        backend = CpuPagedAttention(6, 16, 2, 0.25, attention_chunk_size=chunk)
        out = backend.forward(b.query, b.key, b.value, cache, b.metadata)
        torch.testing.assert_close(out[:n], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend_name", sorted(BACKENDS))
def test_a_chunk_larger_than_every_context_is_full_attention(backend_name):
    """(``cpu_paged`` takes its plain paths then: no query has a chunk start past 0.)"""
    b = _batch(torch.float32, 16)
    backend = BACKENDS[backend_name](6, 16, 2, 0.25, attention_chunk_size=1000)
    out = backend.forward(b.query, b.key, b.value, b.kv_cache, b.metadata)
    n = b.metadata.num_actual_tokens
    torch.testing.assert_close(out[:n], dense_attention(b, 0.25), atol=1e-5, rtol=1e-5)
    assert not any(key.startswith("cpu_paged.chunked") for key in b.metadata.derived)


def test_cpu_paged_cuts_each_request_at_chunk_boundaries():
    """A prefill of 40 tokens in chunks of 8 is five pieces, each reading only its chunk's
    rows (not the whole context), with the answer of the dense reference."""
    b = make_batch(
        [(0, 40), (13, 1)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        block_size=4,
        dtype=torch.float32,
        unwritten_fill=1e4,
    )
    backend = CpuPagedAttention(4, 8, 2, 0.25, attention_chunk_size=8)
    out = backend.forward(b.query, b.key, b.value, b.kv_cache, b.metadata)
    n = b.metadata.num_actual_tokens
    expected = dense_attention(b, 0.25, attention_chunk_size=8)
    torch.testing.assert_close(out[:n], expected, atol=1e-5, rtol=1e-5)
    (parts,) = (v for k, v in b.metadata.derived.items() if k.startswith("cpu_paged.chunked"))
    assert [(p.start, p.stop, len(rows)) for p, rows, _ in parts] == [
        (0, 8, 8),
        (8, 16, 8),
        (16, 24, 8),
        (24, 32, 8),
        (32, 40, 8),
        (40, 41, 6),  # position 13: its chunk's rows 8 .. 13
    ]


def test_a_backend_without_chunked_attention_is_refused():
    class Plain(TorchPagedAttention):
        supports_chunked_attention = False

    with pytest.raises(ValueError, match="does not support chunked local attention"):
        Attention(4, 16, 2, 0.25, 3, Plain, attention_chunk_size=8)
    with pytest.raises(ValueError, match="attention_chunk_size must be >= 1"):
        TorchPagedAttention(4, 16, 2, 0.25, attention_chunk_size=0)
