"""Qwen3-MoE: the Qwen3 decoder (q/k norm) with sparse MoE blocks."""

from __future__ import annotations

from typing import Any

from chassis.builtin_plugins.models.llama import DecoderSpec
from chassis.builtin_plugins.models.sparse_moe import MoeSpec, SparseMoeForCausalLM, qwen_moe_spec


class Qwen3MoeForCausalLM(SparseMoeForCausalLM):
    """``Qwen3MoeForCausalLM`` checkpoints (Qwen3-30B-A3B, Qwen3-235B-A22B): no shared
    expert; ``norm_topk_prob``, ``mlp_only_layers`` and ``decoder_sparse_step`` honoured."""

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec.from_config(hf_config, qk_norm=True)

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoeSpec:
        return qwen_moe_spec(hf_config, shared_expert=False)
