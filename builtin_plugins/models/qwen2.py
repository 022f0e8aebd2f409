"""Qwen2 / Qwen2.5: the Llama decoder with biases on the Q/K/V projections."""

from __future__ import annotations

from typing import Any

from chassis.builtin_plugins.models.llama import (
    DecoderSpec,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    qwen_sliding_layers,
)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """``Qwen2ForCausalLM`` checkpoints (QKV bias always on, no bias on ``o_proj``).

    Sliding-window attention only with ``use_sliding_window: true``, and then in the layers
    :func:`qwen2_sliding_layers` gives.
    """

    supports_pipeline_parallel = True  # (Llama's decoder: stages split it alike)

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec.from_config(
            hf_config, qkv_bias=True, o_bias=False, sliding_layers=qwen2_sliding_layers(hf_config)
        )


class Qwen2ForSequenceClassification(LlamaForSequenceClassification, Qwen2ForCausalLM):
    """``Qwen2ForSequenceClassification`` checkpoints: Qwen2's decoder with the ``score``
    head (see :class:`LlamaForSequenceClassification`)."""


def qwen2_sliding_layers(hf_config: Any) -> frozenset[int]:
    """The layers ``layer_types`` marks ``sliding_attention``; without ``layer_types``, HF's
    Qwen2/Qwen3 rule: layers ``max_window_layers`` and above."""
    first = int(getattr(hf_config, "max_window_layers", 0) or 0)
    return qwen_sliding_layers(hf_config, lambda layer_idx: layer_idx >= first)
