"""Mixture-of-experts layer: a router picks ``top_k`` SwiGLU experts per token.

The experts' weights are stacked the way fused kernels want them: ``w13 [E, 2*I, H]`` (each
expert's gate rows, then its up rows) and ``w2 [E, H, I]``. What the layer computes for
token ``t`` with experts ``e_1..e_k`` and routing weights ``p_1..p_k`` is::

    sum_j p_j * w2[e_j] @ (silu(gate_{e_j} @ x_t) * (up_{e_j} @ x_t))

Three implementations compute it:

- :func:`fused_experts_ref`: one expert at a time over the tokens that chose it, the way HF
  transformers does; the specification that the others are tested against.
- :func:`fused_experts_grouped`: the default torch path. Tokens are sorted by expert once,
  each expert used in the step runs one matmul pair over its contiguous slice, and the ``k``
  results of a token are summed in slot order (deterministic, no atomic adds). It reads the
  expert counts on the host, so it cannot be captured in a CUDA graph.
- a platform's ``fused_moe`` kernel (optional in :class:`~chassis.core.layers.kernels.
  LayerKernels`), which the layer runs when the platform offers one for the tensor.

Some routers scale the expert's *input* instead (Llama 4: ``sum_j w2[e_j] @ (silu(gate_{e_j}
@ (p_j x_t)) * (up_{e_j} @ (p_j x_t)))``, not the same since the expert is not linear):
:func:`experts_on_weighted_input` turns that form into the one above, run by any of the
three, with each (token, slot) pair a row of its own and a weight of 1
(:meth:`FusedMoE.run_routed` with ``weights_on_input=True``).

Expert ids of ``-1`` in ``topk_ids`` name a (token, slot) pair whose expert is on another
rank (expert parallelism): every implementation leaves it out of the sum.

Rounding: each expert's output is computed in the model dtype (as HF does); the weighted sum
over a token's ``k`` experts is taken in float32 and rounded once. HF adds the experts'
contributions into a model-dtype buffer instead, so 16-bit results may be a rounding step
apart from HF's; float32 results agree to float32 precision.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chassis.core import parallel_state
from chassis.core.layers.kernels import kernels_for

__all__ = [
    "FusedMoE",
    "experts_on_weighted_input",
    "fused_experts_grouped",
    "fused_experts_ref",
    "localize_expert_ids",
    "run_experts_grouped",
    "select_experts",
]


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: ``(weights float32 [T, k], expert ids int64 [T, k])``.

    The softmax over all experts is taken in float32; the ``top_k`` largest probabilities are
    kept, largest first (as HF does, with ``torch.topk``; how exact ties break is torch's
    choice) and, with
    ``renormalize``, divided by their sum so that they add up to 1.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def localize_expert_ids(topk_ids: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """``topk_ids`` (global expert ids) as this rank's local ids: ``id - first`` for the
    experts ``[first, first + count)`` it holds, ``-1`` (left out of the sum) for the others.
    No host read."""
    local = topk_ids - first
    return torch.where((local >= 0) & (local < count), local, torch.full_like(local, -1))


def _check_shapes(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    num_experts, two_inter, hidden = w13.shape
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x must be [tokens, {hidden}], got {tuple(x.shape)}")
    if two_inter % 2 or w2.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(
            f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} are not [E, 2I, H] and [E, H, I]"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
            f"must both be [{x.shape[0]}, k]"
        )


def _expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert over the rows of ``x``, in ``x``'s dtype."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def fused_experts_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The reference: ``[T, H]`` in ``x.dtype`` (see the module docstring for the formula).

    ``x [T, H]``; ``w13 [E, 2I, H]``; ``w2 [E, H, I]``; ``topk_weights [T, k]`` of any float
    dtype; ``topk_ids [T, k]`` integer expert ids in ``[0, E)``, or ``-1`` for a pair left
    out (its expert is on another rank).
    """
    _check_shapes(x, w13, w2, topk_weights, topk_ids)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(w13.shape[0]):
        tokens, slots = torch.where(topk_ids == expert)
        if tokens.numel() == 0:
            continue
        y = _expert(x[tokens], w13[expert], w2[expert]).float()
        out.index_put_((tokens,), y * topk_weights[tokens, slots, None].float(), accumulate=True)
    return out.to(x.dtype)


def fused_experts_grouped(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """What :func:`fused_experts_ref` computes, with tokens sorted by expert first."""
    _check_shapes(x, w13, w2, topk_weights, topk_ids)
    return run_experts_grouped(
        x, topk_weights, topk_ids, w13.shape[0], lambda e, rows: _expert(rows, w13[e], w2[e])
    )


def run_experts_grouped(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``sum_j topk_weights[:, j] * expert(topk_ids[:, j], x)``, ``[T, H]`` in ``x``'s dtype:
    the (token, slot) pairs sorted by expert, ``expert(e, rows)`` run once per expert that
    any pair chose (in ``x``'s dtype, ``[n, H] -> [n, H]``), the weighted sum over a token's
    slots in float32, rounded once. Ids of ``-1`` (experts on other ranks) add nothing. One
    host read per call: which experts run and on how many rows."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    # the pairs of id -1 sort first and stay zero
    left_out, *counts = torch.bincount(flat_ids + 1, minlength=num_experts + 1).tolist()
    sorted_x = x[order // top_k]
    sorted_y = torch.empty_like(sorted_x)
    sorted_y[:left_out] = 0
    start = left_out
    for e, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            sorted_y[rows] = expert(e, sorted_x[rows])
            start += count
    y = torch.empty_like(sorted_y)
    y[order] = sorted_y  # back to [token, slot] order
    weighted = y.view(num_tokens, top_k, x.shape[1]).float() * topk_weights.float().unsqueeze(-1)
    return weighted.sum(dim=1).to(x.dtype)


def experts_on_weighted_input(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``sum_j expert_{topk_ids[:, j]}(topk_weights[:, j] * x)``, ``[T, H]`` in ``x``'s dtype.

    ``experts(x, weights, ids)`` is one of the implementations of the module docstring (the
    weights scale outputs); it gets one row per (token, slot) pair, the input scaled in
    ``x``'s dtype (as HF's Llama 4 does), a weight of 1 and the pair's expert. The ``k``
    outputs of a token are summed in float32 and rounded once (with ``k = 1`` the expert's
    output as it is)."""
    num_tokens, top_k = topk_ids.shape
    scaled = x.unsqueeze(1) * topk_weights.to(x.dtype).unsqueeze(-1)  # [T, k, H]
    flat_ids = topk_ids.reshape(num_tokens * top_k, 1)
    ones = torch.ones(flat_ids.shape, dtype=torch.float32, device=x.device)
    y = experts(scaled.reshape(num_tokens * top_k, x.shape[1]), ones, flat_ids)
    if top_k == 1:
        return y
    return y.view(num_tokens, top_k, x.shape[1]).float().sum(dim=1).to(x.dtype)


class FusedMoE(nn.Module):
    """The experts of one sparse MoE block, with their routing.

    ``forward(x [T, H], router_logits [T, E]) -> [T, H]``. Under tensor parallelism every
    rank holds each expert's share of the intermediate dimension; under expert parallelism
    (:func:`~chassis.core.parallel_state.expert_parallel`) it holds the whole of its
    experts ``[expert_start, expert_start + num_local_experts)`` (vLLM's contiguous
    placement, :func:`~chassis.core.parallel_state.expert_split`) and leaves out the
    (token, slot) pairs routed elsewhere. Either way the output is this rank's partial sum:
    the caller all-reduces it (once, together with any shared expert).

    ``renormalize``: divide the top-k probabilities by their sum (Mixtral; Qwen's
    ``norm_topk_prob``). ``intermediate_size_field`` names the config field of
    ``intermediate_size`` in the error when it does not split over the tensor-parallel group. ``round_weights_to_model_dtype``: HF's Qwen MoE blocks round the
    routing weights to the model dtype before scaling the experts' outputs; Mixtral keeps
    them in float32.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool,
        round_weights_to_model_dtype: bool,
        intermediate_size_field: str = "moe_intermediate_size",
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, {num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.round_weights_to_model_dtype = round_weights_to_model_dtype
        #: the whole checkpoint's intermediate size, and this rank's share of it (all of it
        #: under expert parallelism)
        self.full_intermediate_size = intermediate_size
        #: the experts this rank holds: global ids ``[expert_start, expert_start + n)``
        self.expert_start, self.num_local_experts = parallel_state.shard_experts(num_experts)
        self.shard_start, self.intermediate_size = parallel_state.shard_expert_columns(
            intermediate_size, intermediate_size_field
        )
        local = self.num_local_experts
        self.w13 = nn.Parameter(
            torch.empty(local, 2 * self.intermediate_size, hidden_size), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(local, hidden_size, self.intermediate_size), requires_grad=False
        )

    def holds_expert(self, expert: int) -> bool:
        """Whether global expert ``expert`` is on this rank (every one without expert
        parallelism)."""
        return self.expert_start <= expert < self.expert_start + self.num_local_experts

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        if self.round_weights_to_model_dtype:
            weights = weights.to(x.dtype)
        return self.run_routed(x, weights, ids)

    def run_routed(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        *,
        weights_on_input: bool = False,
    ) -> torch.Tensor:
        """The experts on routing computed outside (``weights [T, k]``, global expert
        ``ids [T, k]``): this rank's partial sum ``[T, H]``. ``weights_on_input``: each
        weight scales its expert's input, not its output
        (:func:`experts_on_weighted_input`)."""
        if weights_on_input:
            return experts_on_weighted_input(x, weights, ids, self.run_routed)
        if self.num_local_experts != self.num_experts:
            ids = localize_expert_ids(ids, self.expert_start, self.num_local_experts)
        fused = self._kernel()
        if fused is not None:
            return fused(x, self.w13, self.w2, weights, ids)
        return fused_experts_grouped(x, self.w13, self.w2, weights, ids)

    def _kernel(self) -> Any:
        """The platform's ``fused_moe`` for this layer's weights, or ``None``."""
        kernels = kernels_for(self.w13)
        return getattr(kernels, "fused_moe", None) if kernels is not None else None

    def graph_capture_blocker(self) -> str | None:
        """Why a forward of this layer cannot be captured as a device graph: the torch path
        reads the experts' token counts on the host (see
        :meth:`chassis.core.model_interface.CausalLM.graph_capture_blocker`)."""
        if self._kernel() is not None:
            return None
        return (
            "the mixture-of-experts layers run the torch path, which reads expert counts on "
            "the host (the platform offers no fused_moe kernel for "
            f"{self.w13.dtype} on {self.w13.device.type})"
        )

    @torch.no_grad()
    def load_expert_weight(self, expert: int, projection: str, tensor: torch.Tensor) -> str:
        """Copy one expert's whole checkpoint matrix in (this rank's slice of it).

        ``expert`` is the global id; it must be one this rank holds (:meth:`holds_expert`:
        the loader does not read the others). ``projection`` is ``"gate"`` or ``"up"``
        (``[I, H]``) or ``"down"`` (``[H, I]``). Returns the shard key that was filled
        (``"<expert>.<projection>"``); a wrong expert index, projection or shape is a
        ``ValueError``.
        """
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range [0, {self.num_experts})")
        if not self.holds_expert(expert):
            raise ValueError(
                f"expert {expert} is not on this rank (it holds experts "
                f"[{self.expert_start}, {self.expert_start + self.num_local_experts}))"
            )
        local = expert - self.expert_start
        start, size = self.shard_start, self.intermediate_size
        if projection in ("gate", "up"):
            expected = (self.full_intermediate_size, self.w13.shape[2])
            offset = 0 if projection == "gate" else size
            target = self.w13.data[local, offset : offset + size]
            source = tensor[start : start + size] if tuple(tensor.shape) == expected else None
        elif projection == "down":
            expected = (self.w2.shape[1], self.full_intermediate_size)
            target = self.w2.data[local]
            source = tensor[:, start : start + size] if tuple(tensor.shape) == expected else None
        else:
            raise ValueError(f"unknown expert projection {projection!r}")
        if source is None:
            raise ValueError(
                f"expert {expert} {projection} weight has shape {tuple(tensor.shape)}, "
                f"expected {expected} (does config.json match the weights?)"
            )
        target.copy_(source)
        return f"{expert}.{projection}"

    def shards_needed(self) -> set[str]:
        """Every shard key :meth:`load_expert_weight` must fill before the layer is loaded."""
        experts = range(self.expert_start, self.expert_start + self.num_local_experts)
        return {f"{e}.{p}" for e in experts for p in ("gate", "up", "down")}
