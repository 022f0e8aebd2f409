"""Run by tests/test_expert_parallel.py in a child with ``TRITON_INTERPRET=1``: the Triton
fused MoE kernels (plain and gpt-oss's) over experts split between ranks, pairs of other
ranks' experts given as ``-1``, sum to the one-device reference; prints ``ok``. The
kernels' scratch buffers start as NaN, so a row no kernel writes (the left-out pairs' rows
are the down kernel's to zero) shows in the sums."""

from __future__ import annotations

from typing import Any

import torch

from chassis.builtin_plugins.models.gpt_oss import experts_reference
from chassis.core.layers import triton_moe
from chassis.core.layers.moe import fused_experts_ref, localize_expert_ids, select_experts
from chassis.core.layers.triton_moe import fused_moe, fused_moe_clamped_swiglu


class _NanEmpty:
    """``torch`` for triton_moe, except that ``empty`` float tensors are filled with NaN."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        tensor = torch.empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor


def main() -> None:
    triton_moe.torch = _NanEmpty()  # type: ignore[assignment]
    g = torch.Generator().manual_seed(0)
    tokens, experts, hidden, inter, top_k = 7, 6, 32, 16, 2
    x = torch.randn(tokens, hidden, generator=g)
    w13 = 0.2 * torch.randn(experts, 2 * inter, hidden, generator=g)
    w2 = 0.2 * torch.randn(experts, hidden, inter, generator=g)
    b13 = 0.1 * torch.randn(experts, 2 * inter, generator=g)
    b2 = 0.1 * torch.randn(experts, hidden, generator=g)
    weights, ids = select_experts(torch.randn(tokens, experts, generator=g), top_k, True)
    plain = fused_experts_ref(x, w13, w2, weights, ids)
    biased = experts_reference(x, w13, b13, w2, b2, weights, ids, 1.702, 1.5)
    plain_sum = torch.zeros_like(x)
    biased_sum = torch.zeros_like(x)
    for first, count in ((0, 4), (4, 2), (6, 0)):  # the last rank holds no expert
        local = localize_expert_ids(ids, first, count)
        mine = slice(first, first + count)
        plain_sum += fused_moe(x, w13[mine], w2[mine], weights, local)
        biased_sum += fused_moe_clamped_swiglu(
            x, w13[mine], b13[mine], w2[mine], b2[mine], weights, local, 1.702, 1.5
        )
    torch.testing.assert_close(plain_sum, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(biased_sum, biased, atol=1e-5, rtol=1e-5)
    print("ok")


if __name__ == "__main__":
    main()
