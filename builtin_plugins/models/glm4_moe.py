"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (``Glm4MoeForCausalLM``): Llama attention with partial
RoPE and DeepSeek-V3's mixture of experts.

As HF transformers' ``Glm4Moe`` code defines it, what differs from Llama:

- **Attention**: grouped-query attention with biases on q, k and v by ``attention_bias``
  (never on ``o_proj``); with ``use_qk_norm`` an RMSNorm over each head of q and k before
  RoPE (as Qwen3); RoPE over the first ``head_dim * partial_rotary_factor`` dimensions of
  each head (default 0.5, as HF's config), in Llama's rotate-half layout (unlike GLM-4-0414's
  interleaved one). ``head_dim`` is read from the config.
- **MLP**: DeepSeek-V3's (:mod:`.deepseek_v3`): dense SwiGLU MLPs in the first
  ``first_k_dense_replace`` layers, then a sigmoid ``noaux_tc`` router (float32 weight and
  ``e_score_correction_bias``, group-limited top-k, ``norm_topk_prob``,
  ``routed_scaling_factor``) over ``n_routed_experts`` SwiGLU experts plus ungated
  ``shared_experts``; no MLP biases.
- The checkpoints' multi-token-prediction layer past ``num_hidden_layers`` is not read (HF
  does not load it either).

Weights, the merged q/k/v and gate/up matmuls and tensor parallelism are Llama's and the
other MoE models' (heads and KV heads split, every expert's and the shared and dense MLPs'
intermediate columns split, or whole experts per rank with ``--enable-expert-parallel``;
the q/k norms and the router whole on every rank).
"""

from __future__ import annotations

from typing import Any

from chassis.builtin_plugins.models.deepseek_v2 import DeepseekMoeForCausalLM
from chassis.builtin_plugins.models.deepseek_v3 import NoauxTcRouting
from chassis.builtin_plugins.models.llama import DecoderSpec
from chassis.core.layers.rotary import rope_parameters

#: HF's ``Glm4MoeConfig`` default for ``partial_rotary_factor``
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


class Glm4MoeForCausalLM(NoauxTcRouting, DeepseekMoeForCausalLM):
    """``Glm4MoeForCausalLM`` checkpoints (GLM-4.5, GLM-4.5-Air, GLM-4.6; the module
    docstring)."""

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        rope = rope_parameters(hf_config)
        if rope.get("partial_rotary_factor") is None:
            rope["partial_rotary_factor"] = DEFAULT_PARTIAL_ROTARY_FACTOR
        return DecoderSpec.from_config(
            hf_config,
            qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
            o_bias=False,
            mlp_bias=False,
            qk_norm=bool(getattr(hf_config, "use_qk_norm", False)),
            sliding_window=None,
            rope=rope,
        )
