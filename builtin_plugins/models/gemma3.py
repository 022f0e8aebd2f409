"""Gemma 3 (text): the Gemma 2 layout plus per-head q/k norms and RoPE per layer type."""

from __future__ import annotations

import logging
from typing import Any

from chassis.builtin_plugins.models.gemma import (
    FULL_ATTENTION,
    LAYER_TYPES,
    SLIDING_ATTENTION,
    GemmaForCausalLM,
    GemmaOptions,
    gelu_approximate,
    layer_types_of,
)
from chassis.builtin_plugins.models.gemma2 import optional_float
from chassis.builtin_plugins.models.text_only import TextOnlyWeights
from chassis.core.layers.rotary import rope_parameters

logger = logging.getLogger(__name__)

#: Gemma3TextConfig's RoPE bases when the config names none
_DEFAULT_THETA = {FULL_ATTENTION: 1_000_000.0, SLIDING_ATTENTION: 10_000.0}
#: layers per sliding-window pattern when the config has no layer_types (five local, one global)
_DEFAULT_PATTERN = 6


def rope_by_layer_type(hf_config: Any) -> dict[str, dict[str, Any]]:
    """RoPE parameters of each layer type.

    transformers 5.x keeps them as ``rope_parameters = {"sliding_attention": {...},
    "full_attention": {...}}`` (the full layers may have ``linear`` scaling). The 4.x form —
    ``rope_theta`` and ``rope_scaling`` for the full layers, ``rope_local_base_freq`` for the
    sliding ones — is read too.
    """
    nested = getattr(hf_config, "rope_parameters", None)
    if isinstance(nested, dict) and any(key in nested for key in LAYER_TYPES):
        result = {}
        for layer_type in LAYER_TYPES:
            params = dict(nested.get(layer_type) or {})
            params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
            params.setdefault("rope_theta", _DEFAULT_THETA[layer_type])
            result[layer_type] = params
        return result
    local_theta = getattr(hf_config, "rope_local_base_freq", None)
    return {
        FULL_ATTENTION: rope_parameters(hf_config),
        SLIDING_ATTENTION: {
            "rope_type": "default",
            "rope_theta": float(local_theta or _DEFAULT_THETA[SLIDING_ATTENTION]),
        },
    }


class Gemma3ForCausalLM(GemmaForCausalLM):
    """``Gemma3ForCausalLM`` checkpoints (text-only Gemma 3, e.g. gemma-3-1b-it).

    As Gemma 2, plus a :class:`~chassis.core.layers.norm.GemmaRMSNorm` over each q and k head
    before RoPE, and separate RoPE tables for the sliding and the full layers. Like HF's
    ``Gemma3Attention``, attention scores are not soft-capped even when
    ``attn_logit_softcapping`` is set; ``final_logit_softcapping`` applies when set.
    """

    @classmethod
    def gemma_options(cls, hf_config: Any) -> GemmaOptions:
        num_layers = int(hf_config.num_hidden_layers)
        default_types = [
            FULL_ATTENTION if (i + 1) % _DEFAULT_PATTERN == 0 else SLIDING_ATTENTION
            for i in range(num_layers)
        ]
        if getattr(hf_config, "attn_logit_softcapping", None) is not None:
            logger.info(
                "Gemma 3 ignores attn_logit_softcapping (as HF transformers' Gemma3Attention)"
            )
        return GemmaOptions(
            gelu_approximate=gelu_approximate(getattr(hf_config, "hidden_activation", None)),
            attn_scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
            layer_types=layer_types_of(hf_config, default_types),
            rope_by_layer_type=rope_by_layer_type(hf_config),
            final_logit_softcap=optional_float(getattr(hf_config, "final_logit_softcapping", None)),
            sandwich_norms=True,
            qk_norm=True,
        )


class Gemma3ForConditionalGeneration(TextOnlyWeights, Gemma3ForCausalLM):
    """Multimodal Gemma 3 checkpoints (gemma-3-4b/12b/27b) served as text only.

    The engine builds it from the checkpoint's ``text_config``
    (:func:`~chassis.core.model_loader.language_model_config`); its language model's tensors
    are renamed to the text-only layout (hub files name it ``language_model.model.*``; a
    model transformers 5 re-saves in memory layout, ``model.language_model.*``) and the
    vision tower and projector are never read
    (:class:`~chassis.builtin_plugins.models.text_only.TextOnlyWeights`), so requests with
    text prompts get what the multimodal model answers to text alone. Images are not
    supported.
    """

    language_model_prefixes = (
        ("language_model.model.", "model."),
        ("model.language_model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    )
    vision_prefixes = (
        "vision_tower.",
        "multi_modal_projector.",
        "model.vision_tower.",
        "model.multi_modal_projector.",
    )
