"""Qwen2 / Qwen2.5: the Llama decoder with biases on the Q/K/V projections."""

from __future__ import annotations

from typing import Any

from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """``Qwen2ForCausalLM`` checkpoints (QKV bias always on, no bias on ``o_proj``)."""

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec.from_config(hf_config, qkv_bias=True, o_bias=False)
