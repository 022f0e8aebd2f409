"""The Triton fused-MoE kernels on a real GPU, at a Qwen3-30B-A3B layer's shape (hidden 2048,
moe_intermediate 768, 128 experts, 8 per token), in bfloat16; run by
tests/gpu/run_gpu_checks.sh. Also: a whole ``fused_moe`` call captured in a CUDA graph and
replayed with new inputs (routings that fill the expert groups very differently), and no
synchronizing CUDA call in it.
"""

from __future__ import annotations

import pytest
import torch

from chassis.core.layers.moe import FusedMoE, fused_experts_ref, select_experts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.gpu_moe,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]
HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
#: about two bfloat16 roundings: the kernels and torch may each land one step apart on an
#: intermediate (another accumulation order, another exp) and on the final rounding
TOL = 2**-6


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, atol=TOL, rtol=TOL)


@pytest.fixture(scope="module")
def experts() -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13, w2)`` in bfloat16, scaled so that activations stay O(1)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=g)
    w13 = (w13 / HIDDEN**0.5).bfloat16()
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=g)
    return w13, (w2 / INTER**0.5).bfloat16()


def _inputs(tokens: int, seed: int, skew: float = 0.0) -> tuple[torch.Tensor, ...]:
    """``(x, weights, ids)``: Qwen3-MoE routing (renormalized, weights rounded to bfloat16).
    ``skew`` adds to the logits of experts 0..7, crowding every token into the same groups."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=g).bfloat16()
    logits = torch.randn(tokens, EXPERTS, device="cuda", generator=g)
    logits[:, :TOP_K] += skew
    weights, ids = select_experts(logits, TOP_K, renormalize=True)
    return x, weights.bfloat16(), ids


@pytest.mark.parametrize("tokens", [1, 7, 64, 512])
def test_matches_the_reference_at_qwen3_30b_a3b_shape(experts, tokens: int) -> None:
    from chassis.core.layers.triton_moe import fused_moe

    w13, w2 = experts
    x, weights, ids = _inputs(tokens, seed=tokens)
    _close(fused_moe(x, w13, w2, weights, ids), fused_experts_ref(x, w13, w2, weights, ids))


@pytest.mark.parametrize("tokens", [7, 64])
def test_a_captured_call_replays_with_new_inputs(experts, tokens: int) -> None:
    from chassis.core.layers.triton_moe import fused_moe

    w13, w2 = experts
    static = [t.clone() for t in _inputs(tokens, seed=100)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels, warm the allocator, off the graph
        fused_moe(static[0], w13, w2, static[1], static[2])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(static[0], w13, w2, static[1], static[2])
    # spread routings, then every token crowded into experts 0..7 (many blocks per group)
    for seed, skew in ((1, 0.0), (2, 50.0), (3, 0.0)):
        new = _inputs(tokens, seed=seed, skew=skew)
        for buffer, value in zip(static, new, strict=True):
            buffer.copy_(value)
        graph.replay()
        _close(out, fused_experts_ref(new[0], w13, w2, new[1], new[2]))


def test_a_call_makes_no_synchronizing_cuda_call(experts) -> None:
    from chassis.core.layers.triton_moe import fused_moe

    w13, w2 = experts
    x, weights, ids = _inputs(64, seed=5)
    fused_moe(x, w13, w2, weights, ids)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fused_moe(x, w13, w2, weights, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _close(out, fused_experts_ref(x, w13, w2, weights, ids))


def test_the_layer_runs_the_triton_kernel_on_the_gpu(experts) -> None:
    """FusedMoE on a CUDA tensor takes the platform's fused_moe (bit for bit what the kernel
    gives), with Qwen3-MoE's routing."""
    from chassis.core.layers.triton_moe import fused_moe

    w13, w2 = experts
    with torch.device("meta"):
        layer = FusedMoE(
            EXPERTS, TOP_K, HIDDEN, INTER, renormalize=True, round_weights_to_model_dtype=True
        )
    layer.w13 = torch.nn.Parameter(w13, requires_grad=False)
    layer.w2 = torch.nn.Parameter(w2, requires_grad=False)
    g = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(33, HIDDEN, device="cuda", generator=g).bfloat16()
    logits = torch.randn(33, EXPERTS, device="cuda", generator=g)
    weights, ids = select_experts(logits, TOP_K, renormalize=True)
    with torch.no_grad():
        got = layer(x, logits)
    assert torch.equal(got, fused_moe(x, w13, w2, weights.bfloat16(), ids))
    _close(got, fused_experts_ref(x, w13, w2, weights.bfloat16(), ids))
