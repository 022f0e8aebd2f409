"""Qwen2-MoE: the Qwen2 decoder (QKV bias) with sparse MoE blocks and a shared expert."""

from __future__ import annotations

from typing import Any

from chassis.builtin_plugins.models.llama import DecoderSpec, qwen_sliding_layers
from chassis.builtin_plugins.models.sparse_moe import MoeSpec, SparseMoeForCausalLM, qwen_moe_spec


class Qwen2MoeForCausalLM(SparseMoeForCausalLM):
    """``Qwen2MoeForCausalLM`` checkpoints (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): every sparse
    block adds a shared expert, scaled by ``sigmoid(shared_expert_gate(x))``.

    With ``use_sliding_window: true`` the layers ``layer_types`` marks ``sliding_attention``
    slide; without ``layer_types``, HF's Qwen2-MoE rule: the even-numbered layers below
    ``max_window_layers``.
    """

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        qkv_bias = bool(getattr(hf_config, "qkv_bias", True))
        below = int(getattr(hf_config, "max_window_layers", 0) or 0)
        sliding_layers = qwen_sliding_layers(
            hf_config, lambda layer_idx: layer_idx % 2 == 0 and layer_idx < below
        )
        return DecoderSpec.from_config(
            hf_config, qkv_bias=qkv_bias, o_bias=False, sliding_layers=sliding_layers
        )

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoeSpec:
        return qwen_moe_spec(hf_config, shared_expert=True)
