"""``cpu_paged`` (the CPU's fast backend) against the dense reference and ``torch_paged``."""

from __future__ import annotations

import pytest
import torch
from paged_attention_cases import dense_attention, make_batch

from chassis.builtin_plugins.attention import cpu_paged
from chassis.builtin_plugins.attention.cpu_paged import CpuPagedAttention
from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention

CASES = {
    "decodes": [(5, 1), (17, 1), (1, 1), (32, 1)],
    "prefills": [(0, 7), (0, 1 + 16), (3, 9)],
    "mixed": [(0, 12), (9, 1), (20, 5), (33, 1), (0, 1), (4, 4)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("decode_path", "head_dim"),
    # the compiled kernel's vectorized paths (head_dim 32, 64) and its portable path, and
    # the SDPA fallback used without compiled kernels
    # ("split": prefills over more than 8 positions go to SDPA, shorter ones to the kernel)
    [("kernel", 32), ("kernel", 64), ("kernel", 24), ("split", 64), ("sdpa", 16)],
)
def test_matches_dense_reference_and_torch_paged(
    case, block_size, num_heads, num_kv_heads, dtype, decode_path, head_dim, monkeypatch
):
    if decode_path == "split":
        # the row kernel / SDPA split that runs where the tiled prefill kernel does not
        monkeypatch.setattr(cpu_paged, "KERNEL_MAX_PREFILL_CONTEXT", 8)
        monkeypatch.setattr(CpuPagedAttention, "_tiles_prefills", lambda self, a, b: False)
    scale = head_dim**-0.5

    def batch():
        # Finite junk in slots no request owns: masked positions may be read with weight 0.
        return make_batch(
            CASES[case],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            dtype=dtype,
            num_pad_tokens=2,
            unwritten_fill=1e4,
        )

    b = batch()
    backend = CpuPagedAttention(num_heads, head_dim, num_kv_heads, scale)
    if decode_path == "sdpa":
        backend.kernels = None
    else:
        assert backend.kernels is not None, "the CPU kernels did not build on this machine"
    out = backend.forward(b.query, b.key, b.value, b.kv_cache, b.metadata)
    n = b.metadata.num_actual_tokens
    torch.testing.assert_close(b.kv_cache, b.expected_cache, equal_nan=True, rtol=0, atol=0)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(out[:n].float(), dense_attention(b, scale)[:n].float(), **tol)

    ref_batch = batch()
    ref = TorchPagedAttention(num_heads, head_dim, num_kv_heads, scale).forward(
        ref_batch.query, ref_batch.key, ref_batch.value, ref_batch.kv_cache, ref_batch.metadata
    )
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), **tol)


def test_plan_is_shared_by_layers():
    """The per-step plan is computed once and reused by every layer's call."""
    b = make_batch(
        [(0, 5), (7, 1)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=torch.float32,
        unwritten_fill=1e4,
    )
    backend = CpuPagedAttention(4, 16, 2, 0.25)
    backend.forward(b.query, b.key, b.value, b.kv_cache, b.metadata)
    plan = next(iter(b.metadata.derived.values()))
    backend.forward(b.query, b.key, b.value, b.kv_cache, b.metadata)
    assert next(iter(b.metadata.derived.values())) is plan


def test_short_bf16_prefills_take_the_tiled_kernel():
    backend = CpuPagedAttention(6, 64, 2, 0.125)
    if backend.kernels is None or not backend._tiles_prefills(torch.bfloat16, torch.bfloat16):
        pytest.skip("the tiled prefill kernel needs the compiled kernels and AVX512-BF16")
    b = make_batch(
        CASES["mixed"],
        num_heads=6,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.bfloat16,
        unwritten_fill=1e4,
    )
    backend.forward(b.query, b.key, b.value, b.kv_cache, b.metadata)
    plan = next(iter(b.metadata.derived.values()))
    # chunks of more than one token go to the tiled kernel, one-token ones to the row kernel
    assert plan.tiled is not None and plan.tiled.query_lens.tolist() == [12, 5, 4]
    assert plan.rows is not None and plan.rows.count == 3


#: for a window of 8: prefills shorter and longer than it (40: tiles of 16 rows whose
#: windows start past position 0), chunks over a prefix that starts inside it (3) and before
#: it (12, 100), decodes at its edge (context 8), one past it (9) and far past it (71)
WINDOWED = [(0, 5), (0, 40), (3, 4), (12, 6), (7, 1), (8, 1), (70, 1), (100, 20)]
#: (sliding_window, logits_soft_cap): a window of 1 is the token itself; 1000 exceeds every
#: context (full attention); a cap of 0.5 squeezes every score into (-0.5, 0.5)
WINDOW_CAP = [(8, None), (None, 2.0), (8, 2.0), (1, None), (1000, 0.5)]
#: (kernels, head_dim, KERNEL_MAX_PREFILL_CONTEXT, tiled prefill kernel allowed):
#: "kernel": rows kernel (float32) or tiled prefill kernel (bfloat16); "scalar": the
#: kernels' portable path (head_dim 24); "split": long chunks to SDPA beside the row kernel;
#: "sdpa": no compiled kernels (CHASSIS_CPU_KERNELS=0)
PATHS = {
    "kernel": (True, 64, 512, True),
    "scalar": (True, 24, 512, True),
    "split": (True, 32, 8, False),
    "sdpa": (False, 16, 512, True),
}


def _windowed_backend(path, monkeypatch, **options) -> CpuPagedAttention:
    use_kernels, head_dim, max_context, tiles = PATHS[path]
    monkeypatch.setattr(cpu_paged, "KERNEL_MAX_PREFILL_CONTEXT", max_context)
    if not tiles:
        monkeypatch.setattr(CpuPagedAttention, "_tiles_prefills", lambda self, a, b: False)
    backend = CpuPagedAttention(6, head_dim, 2, head_dim**-0.5, **options)
    if not use_kernels:
        backend.kernels = None
    else:
        assert backend.kernels is not None, "the CPU kernels did not build on this machine"
    return backend


def _windowed_batch(path: str, dtype: torch.dtype, block_size: int = 4, seed: int = 5):
    # The compiled kernels read only positions inside a row's window, so slots no request
    # owns hold NaN (a stray read shows); the SDPA fallback gathers whole blocks and masks
    # them, which needs finite junk there.
    return make_batch(
        WINDOWED,
        num_heads=6,
        num_kv_heads=2,
        head_dim=PATHS[path][1],
        block_size=block_size,
        dtype=dtype,
        num_pad_tokens=2,
        seed=seed,
        unwritten_fill=1e4 if path == "sdpa" else float("nan"),
    )


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize(("sliding_window", "soft_cap"), WINDOW_CAP, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16])
def test_sliding_window_and_soft_cap_match_dense_reference(
    path, sliding_window, soft_cap, dtype, block_size, monkeypatch
):
    options = dict(sliding_window=sliding_window, logits_soft_cap=soft_cap)
    backend = _windowed_backend(path, monkeypatch, **options)
    b = _windowed_batch(path, dtype, block_size)
    out = backend.forward(b.query, b.key, b.value, b.kv_cache, b.metadata)
    n = b.metadata.num_actual_tokens
    torch.testing.assert_close(b.kv_cache, b.expected_cache, equal_nan=True, rtol=0, atol=0)
    expected = dense_attention(b, backend.scale, sliding_window, soft_cap)
    torch.testing.assert_close(out[:n].float(), expected, **_tolerance(dtype))
    if sliding_window == 8 or soft_cap is not None:  # the options change the answer
        assert not torch.allclose(expected, dense_attention(b, backend.scale), atol=0.1)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_with_different_windows_share_one_step_plan(path, dtype, monkeypatch):
    """Gemma-like layers (windowed, full, capped, another window) run one after another on
    one step's metadata: each gets its own answer, and they share one plan."""
    layers = [
        dict(sliding_window=4),
        dict(),
        dict(logits_soft_cap=1.0),
        dict(sliding_window=9, logits_soft_cap=3.0),
        dict(sliding_window=4),
    ]
    backends = [_windowed_backend(path, monkeypatch, **options) for options in layers]
    # one cache per layer; equal seeds give equal metadata, and the first batch's is shared
    batches = [_windowed_batch(path, dtype, seed=7) for _ in layers]
    metadata = batches[0].metadata
    plans = []
    for backend, options, b in zip(backends, layers, batches, strict=True):
        out = backend.forward(b.query, b.key, b.value, b.kv_cache, metadata)
        n = metadata.num_actual_tokens
        expected = dense_attention(
            b, backend.scale, options.get("sliding_window"), options.get("logits_soft_cap")
        )
        torch.testing.assert_close(out[:n].float(), expected, **_tolerance(dtype))
        plans.append(metadata.derived[cpu_paged._PLAN_KEY])
    assert all(plan is plans[0] for plan in plans)


def _two_decodes():
    """Two float32 decodes (contexts 6 and 3) of 4 heads of 32 over 2 KV heads: the row
    kernel's vectorized path."""
    return make_batch(
        [(5, 1), (2, 1)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=4,
        dtype=torch.float32,
    )


def test_window_and_cap_reach_the_kernels_only_when_set(monkeypatch):
    """A layer without the options makes the kernel calls it made before they existed."""
    backend = CpuPagedAttention(4, 32, 2, 0.2)
    if backend.kernels is None:
        pytest.skip("needs the compiled kernels")
    calls = []

    class Recording:
        def __init__(self, ops):
            self.ops = ops

        def __getattr__(self, name):
            def call(*args):
                calls.append((name, len(args)))
                return getattr(self.ops, name)(*args)

            return call

    for options, extra in ((dict(), 0), (dict(sliding_window=3, logits_soft_cap=2.0), 2)):
        calls.clear()
        layer = CpuPagedAttention(4, 32, 2, 0.2, **options)
        layer.kernels = Recording(layer.kernels)
        b = _two_decodes()
        layer.forward(b.query, b.key, b.value, b.kv_cache, b.metadata)
        assert ("decode_attention", 5 + extra) in calls


#: (sliding_window, logits_soft_cap) combined with attention sinks
SINK_OPTIONS = [(None, None), (8, None), (8, 2.0), (1, None)]


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize(("sliding_window", "soft_cap"), SINK_OPTIONS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_sinks_match_dense_reference(path, sliding_window, soft_cap, dtype, monkeypatch):
    """gpt-oss's per-head sink logits on every path (row kernel, tiled prefill kernel, the
    portable kernel, SDPA beside the kernels and without them): prefills longer than the
    window, chunks over cached prefixes, decodes past the window, GQA."""
    sinks = (2 * torch.randn(6, generator=torch.Generator().manual_seed(3))).to(dtype)
    options = dict(sliding_window=sliding_window, logits_soft_cap=soft_cap, sinks=sinks)
    backend = _windowed_backend(path, monkeypatch, **options)
    b = _windowed_batch(path, dtype, block_size=4, seed=9)
    out = backend.forward(b.query, b.key, b.value, b.kv_cache, b.metadata)
    n = b.metadata.num_actual_tokens
    torch.testing.assert_close(b.kv_cache, b.expected_cache, equal_nan=True, rtol=0, atol=0)
    expected = dense_attention(b, backend.scale, sliding_window, soft_cap, sinks)
    torch.testing.assert_close(out[:n].float(), expected, **_tolerance(dtype))
    without = dense_attention(b, backend.scale, sliding_window, soft_cap)
    assert not torch.allclose(expected, without, atol=0.1)


def test_sinks_reach_the_kernels_as_a_third_option(monkeypatch):
    """A layer with sinks passes (window, cap, sinks) to the kernels, the parameter itself
    (the kernels read it at each call, in float32)."""
    backend = CpuPagedAttention(4, 32, 2, 0.2)
    if backend.kernels is None:
        pytest.skip("needs the compiled kernels")
    sinks = torch.zeros(4)
    layer = CpuPagedAttention(4, 32, 2, 0.2, sinks=sinks)
    assert layer._kernel_options == (0, 0.0, sinks)
    b = _two_decodes()
    sinks.fill_(-1.5)  # filled after construction, as the model's weights are
    out = layer.forward(b.query, b.key, b.value, b.kv_cache, b.metadata)
    expected = dense_attention(b, 0.2, sinks=sinks)
    torch.testing.assert_close(out[: b.metadata.num_actual_tokens], expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="sinks must be a float CPU tensor"):
        backend.kernels.decode_attention(
            b.query,
            b.kv_cache,
            b.metadata.block_table,
            b.metadata.seq_lens,
            0.2,
            0,
            0.0,
            torch.zeros(3),
        )
