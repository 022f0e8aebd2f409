"""rednote dots.llm1 (``Dots1ForCausalLM``): Qwen3's attention with DeepSeek-V3's mixture of
experts.

As HF transformers' ``Dots1`` code defines it, what differs from Llama:

- **Attention**: Qwen3's: an RMSNorm over each head of q and k before RoPE (``head_dim``
  read from the config); ``attention_bias`` puts biases on all of q, k, v *and* ``o_proj``;
  the layers whose ``layer_types`` entry is ``sliding_attention`` (by default those from
  ``max_window_layers`` on, when ``sliding_window`` is set) attend over the last
  ``sliding_window`` positions. RoPE over whole heads (``partial_rotary_factor`` other than 1
  is refused: HF's default RoPE does not read it).
- **MLP**: DeepSeek-V3's (:mod:`.deepseek_v3`): dense SwiGLU MLPs in the first
  ``first_k_dense_replace`` layers, then a sigmoid ``noaux_tc`` router (float32 weight and
  ``e_score_correction_bias``, group-limited top-k over ``n_group``/``topk_group``,
  ``norm_topk_prob``, ``routed_scaling_factor``) over ``n_routed_experts`` SwiGLU experts of
  ``moe_intermediate_size`` plus ungated ``shared_experts`` (``n_shared_experts *
  moe_intermediate_size``); no MLP biases. The checkpoint names are DeepSeek-V3's.

Unlike HF (which fails to build), a config without ``n_shared_experts`` builds with no
shared expert. Refused: a ``hidden_act`` other than ``silu``, a ``scoring_func`` other than
``sigmoid`` or a ``topk_method`` other than ``noaux_tc`` (fields HF does not read), groups
that do not split the experts.

Weights, the merged q/k/v and gate/up matmuls and tensor parallelism are Llama's and the
other MoE models' (heads and KV heads split, every expert's and the shared and dense MLPs'
intermediate columns split, or whole experts per rank with ``--enable-expert-parallel``;
the per-head q/k norms and the router whole on every rank; ``o_proj``'s bias added once).
"""

from __future__ import annotations

from typing import Any

from chassis.builtin_plugins.models.deepseek_v2 import DeepseekMoeForCausalLM
from chassis.builtin_plugins.models.deepseek_v3 import NoauxTcRouting
from chassis.builtin_plugins.models.llama import DecoderSpec, qwen_sliding_layers
from chassis.core.layers.rotary import rope_parameters


class Dots1ForCausalLM(NoauxTcRouting, DeepseekMoeForCausalLM):
    """``Dots1ForCausalLM`` checkpoints (dots.llm1.base, dots.llm1.inst; the module
    docstring)."""

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        rope = rope_parameters(hf_config)
        partial = rope.get("partial_rotary_factor")
        if partial is not None and float(partial) != 1.0:
            raise ValueError(
                f"config partial_rotary_factor {partial} is not supported: dots.llm1 rotates "
                "whole heads (HF's Dots1 does not read the field)"
            )
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        max_window_layers = getattr(hf_config, "max_window_layers", None)
        if max_window_layers is None:
            max_window_layers = int(hf_config.num_hidden_layers)
        # HF's Dots1 slides by layer_types alone (a use_sliding_window field is not read);
        # a window of at least max_position_embeddings never cuts anything off
        window = getattr(hf_config, "sliding_window", None)
        window = int(window) if window else None
        if window is not None and window >= int(hf_config.max_position_embeddings):
            window = None
        return DecoderSpec.from_config(
            hf_config,
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=False,
            qk_norm=True,
            rope=rope,
            sliding_window=window,
            # HF's rule when the config has no layer_types: the layers from
            # max_window_layers on slide
            sliding_layers=qwen_sliding_layers(hf_config, lambda i: i >= max_window_layers),
        )
