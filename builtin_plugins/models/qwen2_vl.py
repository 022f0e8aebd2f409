"""Qwen2-VL and Qwen2.5-VL: the multimodal checkpoints' Qwen2 language model, served as text
only.

Their language model rotates q and k by M-RoPE: three position ids per token (temporal,
height, width), the rotary frequencies split into ``mrope_section`` groups, group ``i``
turned by position component ``i % 3``. For text, HF gives the three components the same
value (the token's index), so every frequency is turned by that one position: the rotation is
ordinary (1D, rotate-half) RoPE with the text config's ``rope_theta``, which is what the
Qwen2 decoder applies (tests/test_multimodal_text_models.py checks the tables against HF's).
"""

from __future__ import annotations

from typing import Any

from chassis.builtin_plugins.models.llama import DecoderSpec
from chassis.builtin_plugins.models.qwen2 import Qwen2ForCausalLM, qwen2_sliding_layers
from chassis.builtin_plugins.models.text_only import TextOnlyWeights, wrapper_tie_word_embeddings


class Qwen2VLForConditionalGeneration(TextOnlyWeights, Qwen2ForCausalLM):
    """``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration``
    checkpoints served as text only (Qwen2's decoder: Q/K/V biases, ``head_dim`` =
    ``hidden_size / num_attention_heads`` as HF's attention computes it).

    Hub files name the language model ``model.*`` and ``lm_head.*`` beside the vision tower's
    ``visual.*`` (transformers 5 writes that layout too); its in-memory layout,
    ``model.language_model.*`` and ``model.visual.*``, is read too. The vision tower and
    its merger are never read. The LM head is tied by the checkpoint's top-level
    ``tie_word_embeddings``, as in transformers.
    """

    language_model_prefixes = (("model.language_model.", "model."),)
    vision_prefixes = ("visual.", "model.visual.")

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec.from_config(
            hf_config,
            qkv_bias=True,
            o_bias=False,
            head_dim=int(hf_config.hidden_size) // int(hf_config.num_attention_heads),
            sliding_layers=qwen2_sliding_layers(hf_config),
        )

    def build_head(self, hf_config: Any) -> None:
        super().build_head(wrapper_tie_word_embeddings(hf_config))
