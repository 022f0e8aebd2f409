"""``AttentionMetadata.attend_limit`` (bidirectional image blocks) on every built-in backend
against a dense float32 reference, and the scheduler's rule for chunks around such blocks.

A mixed step (tests/paged_attention_cases.py): prefill chunks whose tokens inside a block
attend up to the block's last position (a block inside a chunk from scratch, one that starts
before the chunk over a cached prefix, one ending at the chunk's end), decodes beside them,
padding; with no window, a window of 4 (shorter than the blocks: HF's ``sliding AND
(causal OR block)``), and a window with a logit soft cap. ``torch_paged`` and ``cpu_paged``
run here; ``triton_paged`` under Triton's interpreter in a child pytest of this file
(``TRITON_INTERPRET=1``, as tests/test_triton_attention.py), with a forced KV split too, and
its variant compiles for Hopper / MI300.
"""

from __future__ import annotations

import pytest
import torch
from paged_attention_cases import PagedBatch, make_batch
from triton_compile_check import (
    TARGETS,
    compile_attention_variant,
    in_interpreter,
    interpreter_parent,
    not_in_interpreter,
    run_kernel_tests,
)

from chassis.core.bidirectional_blocks import chunk_outside_blocks

#: (cached prefix, query length) per request, and each request's blocks (begin, end)
SPECS = [(0, 12), (5, 9), (13, 1), (0, 1), (20, 6)]
BLOCKS = [[(2, 8)], [(3, 10)], [], [], [(21, 26)]]
#: (sliding_window, logits_soft_cap)
OPTIONS = [(None, None), (4, None), (4, 2.0)]


def with_limits(dtype: torch.dtype, device: str = "cpu") -> tuple[PagedBatch, torch.Tensor]:
    """The step (GQA 4 over 2 heads of 16, blocks of 4, 2 padding tokens) with its
    ``attend_limit``: each token's position, or its block's last position."""
    batch = make_batch(
        SPECS,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=dtype,
        device=device,
        num_pad_tokens=2,
        seed=3,
        # large and finite: torch_paged's padded decode gather multiplies unread slots by a
        # zero weight, which NaN would poison; a backend giving them weight still fails
        unwritten_fill=1e4,
    )
    limits: list[int] = []
    for (prefix, query_len), blocks in zip(SPECS, BLOCKS, strict=True):
        for pos in range(prefix, prefix + query_len):
            inside = [end - 1 for begin, end in blocks if begin <= pos < end]
            limits.append(inside[0] if inside else pos)
    limit = torch.tensor([*limits, 0, 0], dtype=torch.int32, device=device)
    batch.metadata.attend_limit = limit
    return batch, limit


def dense(batch: PagedBatch, limit: torch.Tensor, window: int | None, cap: float | None):
    """float32 reference: query ``t`` at position ``p`` sees keys ``k <= limit[t]`` and, with
    a window, ``k > p - window``."""
    outs, start = [], 0
    for prefix, query_len, ctx_k, ctx_v in batch.contexts:
        q = batch.query[start : start + query_len].float().cpu()
        last = limit[start : start + query_len].long().cpu()[:, None]
        start += query_len
        group = q.shape[1] // ctx_k.shape[1]
        k = ctx_k.float().repeat_interleave(group, dim=1)
        v = ctx_v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * 16**-0.5
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        q_pos = prefix + torch.arange(query_len)[:, None]
        k_pos = torch.arange(k.shape[0])[None, :]
        visible = k_pos <= last
        if window is not None:
            visible &= k_pos > q_pos - window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(outs)


def run_backend(backend_cls: type, batch: PagedBatch, window: int | None, cap: float | None):
    options = {"sliding_window": window, "logits_soft_cap": cap}
    backend = backend_cls(4, 16, 2, 16**-0.5, **{k: v for k, v in options.items() if v})
    assert backend_cls.supports_attend_limit
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    return out[: batch.metadata.num_actual_tokens].float().cpu()


@not_in_interpreter
@pytest.mark.parametrize("backend", ["torch_paged", "cpu_paged"])
@pytest.mark.parametrize(("window", "cap"), OPTIONS)
def test_cpu_backends_honour_attend_limit(backend: str, window, cap) -> None:
    from chassis.builtin_plugins.attention.cpu_paged import CpuPagedAttention
    from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention

    cls = {"torch_paged": TorchPagedAttention, "cpu_paged": CpuPagedAttention}[backend]
    batch, limit = with_limits(torch.float32)
    expected = dense(batch, limit, window, cap)
    torch.testing.assert_close(run_backend(cls, batch, window, cap), expected, atol=1e-5, rtol=0)
    # the limits matter: the causal answer differs on the blocks' rows
    batch.metadata.attend_limit = None
    batch.metadata.derived.clear()  # (cpu_paged's plan of the step is memoized there)
    causal = run_backend(cls, batch, window, cap)
    assert (causal - expected).abs().max() > 1e-2


@not_in_interpreter
def test_cpu_paged_bfloat16_with_limit_near_torch_paged() -> None:
    from chassis.builtin_plugins.attention.cpu_paged import CpuPagedAttention
    from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention

    batch, limit = with_limits(torch.bfloat16)
    expected = dense(batch, limit, 4, None)
    for cls in (TorchPagedAttention, CpuPagedAttention):
        got = run_backend(cls, batch, 4, None)
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=0)


@interpreter_parent
def test_triton_under_interpreter(request: pytest.FixtureRequest) -> None:
    output = run_kernel_tests(__file__, request)
    assert "passed" in output, output[-2000:]


@in_interpreter
@pytest.mark.parametrize(("window", "cap"), OPTIONS)
def test_triton_paged_honours_attend_limit(window, cap) -> None:
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels
    from chassis.builtin_plugins.attention.triton_paged import TritonPagedAttention

    batch, limit = with_limits(torch.float32)
    expected = dense(batch, limit, window, cap)
    got = run_backend(TritonPagedAttention, batch, window, cap)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    # the same with the KV range split over programs and combined
    out = torch.empty_like(batch.query)
    kernels.paged_attention(
        batch.query,
        batch.kv_cache,
        out,
        **batch.kernel_args(16**-0.5),
        sliding_window=window,
        logits_soft_cap=cap,
        attend_limit=limit,
        num_splits=2,
    )
    n = batch.metadata.num_actual_tokens
    torch.testing.assert_close(out[:n].float(), expected, atol=1e-5, rtol=0)


@not_in_interpreter
@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t[0]}-{t[1]}")
def test_triton_limit_variant_compiles_for_gpu_targets(target) -> None:
    """Gemma-3-like prefill (GQA 2, head_dim 256, window) with the limit, bf16 and fp32."""
    pytest.importorskip("triton")
    for fp32 in (False, True):
        compile_attention_variant(
            target,
            group=2,
            head_dim=256,
            block_m=64,
            tile_n=64,
            fp32=fp32,
            num_warps=8,
            sliding_window=True,
            attend_limit=True,
        )


@not_in_interpreter
def test_triton_refuses_a_bad_limit() -> None:
    pytest.importorskip("triton")
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    batch, limit = with_limits(torch.float32)
    with pytest.raises(ValueError, match="attend_limit must be an int32"):
        kernels.paged_attention(
            batch.query,
            batch.kv_cache,
            torch.empty_like(batch.query),
            **batch.kernel_args(0.25),
            attend_limit=limit.long(),
        )


# -- the scheduler's rule ---------------------------------------------------------------------


def test_chunks_never_end_inside_a_block() -> None:
    blocks = [(4, 20), (30, 46)]
    assert chunk_outside_blocks(0, 16, blocks) == 4  # would end inside: ends at its start
    assert chunk_outside_blocks(0, 4, blocks) == 4  # ends at its start
    assert chunk_outside_blocks(0, 20, blocks) == 20  # ends at its end
    assert chunk_outside_blocks(4, 16, blocks) == 16  # the whole block
    assert chunk_outside_blocks(4, 8, blocks) == 0  # starts at it: the rest must fit
    assert chunk_outside_blocks(10, 5, blocks) == 0  # starts inside (a prefix-cache hit)
    assert chunk_outside_blocks(10, 10, blocks) == 10  # the rest of it
    assert chunk_outside_blocks(10, 25, blocks) == 20  # through it, then up to the next
    assert chunk_outside_blocks(50, 3, blocks) == 3  # past every block (decodes)
    assert chunk_outside_blocks(0, 16, []) == 16


def test_the_runner_refuses_limits_past_the_context() -> None:
    """A chunk that ended inside a block (a scheduler that ignored the rule) fails the step."""
    import numpy as np

    from chassis.core.model_runner import check_attend_limits

    check_attend_limits(np.array([0, 2, 2]), np.array([3, 3, 3]), ["a"])
    with pytest.raises(RuntimeError, match="ends inside an image block"):
        check_attend_limits(np.array([0, 5, 5]), np.array([3, 3, 3]), ["a"])
