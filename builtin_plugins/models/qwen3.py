"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from typing import Any

from chassis.builtin_plugins.models.llama import (
    DecoderSpec,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
)
from chassis.builtin_plugins.models.qwen2 import qwen2_sliding_layers


class Qwen3ForCausalLM(LlamaForCausalLM):
    """``Qwen3ForCausalLM`` checkpoints (``q_norm``/``k_norm``; ``head_dim`` from the config).

    Sliding-window layers as in Qwen2 (``use_sliding_window``, then ``layer_types`` or
    ``max_window_layers``).
    """

    supports_pipeline_parallel = True  # (Llama's decoder: stages split it alike)

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec.from_config(
            hf_config, qk_norm=True, sliding_layers=qwen2_sliding_layers(hf_config)
        )


class Qwen3ForSequenceClassification(LlamaForSequenceClassification, Qwen3ForCausalLM):
    """``Qwen3ForSequenceClassification`` checkpoints: Qwen3's decoder with the ``score``
    head (see :class:`~chassis.builtin_plugins.models.llama.LlamaForSequenceClassification`)."""
