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
