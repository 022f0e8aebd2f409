"""Expert parallelism's kernel path on a real GPU, run by tests/gpu/run_gpu_checks.sh (marker
``gpu_moe``: its ``moe`` step).

One GPU stands in for the ranks: the experts are split into contiguous ranges as
``parallel_state.expert_split`` places them, each "rank" runs the Triton fused MoE
(plain, and gpt-oss's) on its own experts with the other ranks' pairs given as ``-1``
(``localize_expert_ids``), and the partial outputs, summed in float32 as the all-reduce
would, must match the kernel over all experts in bfloat16. One call is captured in a CUDA
graph and replayed with another routing (the ``-1`` pairs change from call to call).
"""

from __future__ import annotations

import pytest
import torch

from chassis.core.layers.moe import localize_expert_ids, select_experts
from chassis.core.parallel_state import expert_split

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.gpu_moe,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]
HIDDEN, INTER, EXPERTS, TOP_K = 1024, 512, 30, 4
#: outputs have an rms of about 1; each rank's output rounds to bfloat16 once before the sum
TOL = 2**-5


def _weights(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (scale * torch.randn(*shape, device="cuda", generator=g)).bfloat16()

    return (
        randn(EXPERTS, 2 * INTER, HIDDEN, scale=2.0 / HIDDEN**0.5),
        randn(EXPERTS, 2 * INTER, scale=0.5),
        randn(EXPERTS, HIDDEN, INTER, scale=1.0 / INTER**0.5),
        randn(EXPERTS, HIDDEN, scale=0.5),
    )


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=g).bfloat16()
    logits = torch.randn(tokens, EXPERTS, device="cuda", generator=g)
    weights, ids = select_experts(logits, TOP_K, True)
    return x, weights.bfloat16(), ids


@pytest.mark.parametrize("ranks", [2, 4, 8])  # 30 experts: 15+15, 8+8+7+7, 4x6 + 3x2
@pytest.mark.parametrize("tokens", [1, 37, 512])
def test_ranks_sum_to_the_kernel_over_all_experts(ranks: int, tokens: int) -> None:
    from chassis.core.layers.triton_moe import fused_moe, fused_moe_clamped_swiglu

    w13, b13, w2, b2 = _weights(0)
    x, weights, ids = _routing(tokens, tokens)
    plain = torch.zeros(tokens, HIDDEN, device="cuda")
    biased = torch.zeros(tokens, HIDDEN, device="cuda")
    for rank in range(ranks):
        first, count = expert_split(EXPERTS, ranks, rank)
        mine = slice(first, first + count)
        local = localize_expert_ids(ids, first, count)
        plain += fused_moe(x, w13[mine], w2[mine], weights, local).float()
        biased += fused_moe_clamped_swiglu(
            x, w13[mine], b13[mine], w2[mine], b2[mine], weights, local, 1.702, 7.0
        ).float()
    expected = fused_moe(x, w13, w2, weights, ids).float()
    torch.testing.assert_close(plain, expected, atol=TOL, rtol=TOL)
    expected = fused_moe_clamped_swiglu(x, w13, b13, w2, b2, weights, ids, 1.702, 7.0).float()
    torch.testing.assert_close(biased, expected, atol=TOL, rtol=TOL)


def test_a_rank_replays_in_a_graph_with_other_routings() -> None:
    from chassis.core.layers.triton_moe import fused_moe

    w13, _, w2, _ = _weights(1)
    first, count = expert_split(EXPERTS, 4, 1)
    mine = slice(first, first + count)
    x, weights, ids = _routing(8, 3)
    local = localize_expert_ids(ids, first, count)
    fused_moe(x, w13[mine], w2[mine], weights, local)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13[mine], w2[mine], weights, local)
    for seed in (4, 5):
        new_x, new_weights, new_ids = _routing(8, seed)
        x.copy_(new_x)
        weights.copy_(new_weights)
        local.copy_(localize_expert_ids(new_ids, first, count))
        graph.replay()
        expected = fused_moe(x, w13[mine], w2[mine], weights, local)
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
