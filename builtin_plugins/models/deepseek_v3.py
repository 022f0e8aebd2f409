"""DeepSeek-V3 (V3, V3.1, R1; Kimi K2, Moonlight): DeepSeek-V2's multi-head latent attention
and mixture of experts (:mod:`.deepseek_v2`, whose docstring says what differs from Llama)
with another router.

As HF transformers' ``DeepseekV3`` code defines it, what differs from V2:

- **Router** (``noaux_tc``): ``scores = sigmoid(x @ gate.weight^T)`` in float32; the choice
  adds ``gate.e_score_correction_bias`` (a float32 per-expert bias, used only to choose).
  The experts split into ``n_group`` groups; each group scores the sum of its two best
  biased scores, a token keeps its ``topk_group`` best groups and takes the
  ``num_experts_per_tok`` best biased scores among their experts. The routing weights are
  the *unbiased* scores of those experts, divided by their sum (plus 1e-20) with
  ``norm_topk_prob``, times ``routed_scaling_factor``.
- **RoPE layout**: interleaved pairs (``2i, 2i + 1``) with ``rope_interleave`` (the default),
  else Llama's halves.
- The dense and shared MLPs have no biases (no ``mlp_bias``).
- Checkpoints of V3/R1 carry a multi-token-prediction layer past ``num_hidden_layers``
  (``model.layers.61``): not read (HF does not load it either); speculative decoding
  method ``mtp`` drafts with it (:mod:`.deepseek_mtp`).

A ``scoring_func`` other than ``sigmoid`` or a ``topk_method`` other than ``noaux_tc`` (fields
HF's config keeps but does not read) is refused when the model is built.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chassis.builtin_plugins.models.deepseek_v2 import (
    DeepseekV2ForCausalLM,
    RouterSpec,
    group_expert_mask,
)


class DeepseekV3Router(nn.Module):
    """V3's ``noaux_tc`` router (the module docstring): ``weight [E, hidden]`` and
    ``e_score_correction_bias [E]``, both float32 as HF keeps them.
    ``forward(x) -> (weights float32 [T, k], ids int64 [T, k])``."""

    def __init__(self, spec: RouterSpec, hidden_size: int) -> None:
        super().__init__()
        self.spec = spec
        num_experts = spec.num_experts
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False
        )
        self.e_score_correction_bias = nn.Parameter(
            torch.empty(num_experts, dtype=torch.float32), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        per_group = spec.num_experts // spec.n_group
        group_scores = choice.view(-1, spec.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        choice = choice.masked_fill(~group_expert_mask(group_scores, spec), float("-inf"))
        ids = torch.topk(choice, spec.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if spec.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * spec.routed_scaling_factor, ids


class NoauxTcRouting:
    """The routing of :class:`DeepseekV3Router` for a :class:`DeepseekMoeForCausalLM`
    (listed before it among the bases; DeepSeek-V3 and GLM-4.5 share it): ``topk_method``
    ``noaux_tc``, ``scoring_func`` ``sigmoid``, ``n_group``/``topk_group`` read (default 1:
    one group), each group holding at least the two experts its score sums."""

    topk_methods = ("noaux_tc",)
    scoring_func = "sigmoid"

    @classmethod
    def router_spec(cls, hf_config: Any) -> RouterSpec:
        spec = super().router_spec(hf_config)  # type: ignore[misc]
        n_group = getattr(hf_config, "n_group", None) or 1
        topk_group = getattr(hf_config, "topk_group", None) or 1
        for field, value in (("n_group", n_group), ("topk_group", topk_group)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config {field} must be a positive integer; got {value!r}")
        num_experts = spec.num_experts
        if num_experts % n_group or topk_group > n_group or num_experts // n_group < 2:
            raise ValueError(
                f"config n_group {n_group} must divide n_routed_experts {num_experts} into "
                f"groups of at least 2 experts and be at least topk_group {topk_group}"
            )
        if spec.top_k > num_experts // n_group * topk_group:
            raise ValueError(
                f"config num_experts_per_tok {spec.top_k} exceeds the experts of topk_group "
                f"{topk_group} groups ({num_experts // n_group * topk_group})"
            )
        return dataclasses.replace(spec, n_group=n_group, topk_group=topk_group)

    def make_router(self) -> nn.Module:
        return DeepseekV3Router(self.router, self.spec.hidden_size)  # type: ignore[attr-defined]


class DeepseekV3ForCausalLM(NoauxTcRouting, DeepseekV2ForCausalLM):
    """``DeepseekV3ForCausalLM`` checkpoints (DeepSeek-V3/V3.1/R1, Kimi K2, Moonlight; the
    module docstring)."""

    @classmethod
    def rope_interleaved(cls, hf_config: Any) -> bool:
        return bool(getattr(hf_config, "rope_interleave", True))

    @classmethod
    def dense_mlp_bias(cls, hf_config: Any) -> bool:
        return False
