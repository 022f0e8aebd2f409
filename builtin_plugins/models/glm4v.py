"""GLM-4.1V (``Glm4vForConditionalGeneration``) and GLM-4.5V
(``Glm4vMoeForConditionalGeneration``): the multimodal checkpoints' GLM-4 / GLM-4.5 language
model, served as text only.

Their language model rotates q and k by M-RoPE: three position ids per token (temporal,
height, width); the rotary frequencies (``head_dim * partial_rotary_factor / 2`` of them) are
split into ``mrope_section`` groups, group ``i`` turned by position component ``i % 3``. For
text HF gives the three components the same value (the token's index), so every frequency is
turned by that one position: ordinary partial RoPE with the text config's ``rope_theta``, in
the layout each text model has without images:

- GLM-4.1V duplicates each frequency in place (``repeat_interleave(2)``) and pairs dimension
  ``2i`` with ``2i + 1`` (``rotate_half_llm``): GLM-4-0414's interleaved partial RoPE, as
  :class:`~.glm4.Glm4ForCausalLM` applies it;
- GLM-4.5V concatenates the two halves (``cat([freq, freq])``) and rotates halves: GLM-4.5's
  rotate-half partial RoPE, as :class:`~.glm4_moe.Glm4MoeForCausalLM` applies it.

tests/test_more_multimodal_text_models.py checks both tables against HF's rotary modules.
"""

from __future__ import annotations

from typing import Any

from chassis.builtin_plugins.models.glm4 import Glm4ForCausalLM
from chassis.builtin_plugins.models.glm4_moe import Glm4MoeForCausalLM
from chassis.builtin_plugins.models.llama import DecoderSpec
from chassis.builtin_plugins.models.text_only import TextOnlyWeights, wrapper_tie_word_embeddings
from chassis.core.layers.rotary import rope_parameters

#: language model and LM head (transformers 5 and the hub files), then the older layout
_LANGUAGE_MODEL_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_PREFIXES = ("model.visual.", "visual.")


class Glm4vForConditionalGeneration(TextOnlyWeights, Glm4ForCausalLM):
    """``Glm4vForConditionalGeneration`` checkpoints (GLM-4.1V-9B-Thinking / Base) served as
    text only: GLM-4's decoder (the two extra norms per layer, the fused ``gate_up_proj``,
    interleaved partial RoPE) with the options HF's ``Glm4vTextAttention`` hard-codes:
    biases on q, k and v always (whatever ``attention_bias`` says), none on ``o_proj``,
    ``head_dim`` = ``hidden_size / num_attention_heads`` and RoPE over the whole head unless
    the config names a ``partial_rotary_factor`` (the released config.json says 0.5).

    Files name the language model ``model.language_model.*`` and ``lm_head.*``; the vision
    tower (``model.visual.*``) is never read. The LM head is tied by the checkpoint's
    top-level ``tie_word_embeddings``, as in transformers.
    """

    language_model_prefixes = _LANGUAGE_MODEL_PREFIXES
    vision_prefixes = _VISION_PREFIXES

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        rope = {**rope_parameters(hf_config), "interleaved": True}
        if rope.get("partial_rotary_factor") is None:
            rope["partial_rotary_factor"] = 1.0  # HF's Glm4vTextRotaryEmbedding's default
        return DecoderSpec.from_config(
            hf_config,
            qkv_bias=True,
            o_bias=False,
            mlp_bias=False,
            head_dim=int(hf_config.hidden_size) // int(hf_config.num_attention_heads),
            sliding_window=None,
            rope=rope,
        )

    def build_head(self, hf_config: Any) -> None:
        super().build_head(wrapper_tie_word_embeddings(hf_config))


class Glm4vMoeForConditionalGeneration(TextOnlyWeights, Glm4MoeForCausalLM):
    """``Glm4vMoeForConditionalGeneration`` checkpoints (GLM-4.5V) served as text only:
    GLM-4.5's decoder (rotate-half partial RoPE, default factor 0.5; q/k/v biases by
    ``attention_bias``; no q/k norms; DeepSeek-V3's sigmoid ``noaux_tc`` routing over the
    routed experts plus the shared ones after ``first_k_dense_replace`` dense layers).

    Names and the LM head's tying as GLM-4.1V.
    """

    language_model_prefixes = _LANGUAGE_MODEL_PREFIXES
    vision_prefixes = _VISION_PREFIXES

    def build_head(self, hf_config: Any) -> None:
        super().build_head(wrapper_tie_word_embeddings(hf_config))
