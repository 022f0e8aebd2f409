"""Mistral 3 (Mistral Small 3.1/3.2, Magistral/Devstral Small in this format) and Ministral 3:
the multimodal checkpoints' Mistral / Ministral 3 language model, served as text only.

The registered class, :class:`~.mistral3_images.Mistral3ForConditionalGenerationWithImages`,
is this one with the image side added; this one serves the checkpoints whose image side it
does not build (another tower, a list of feature layers)."""

from __future__ import annotations

from typing import Any

from chassis.builtin_plugins.models.llama import DecoderSpec
from chassis.builtin_plugins.models.ministral3 import Ministral3ForCausalLM
from chassis.builtin_plugins.models.text_only import TextOnlyWeights

#: text configs served: the Llama/Mistral decoder, and Ministral 3's (queries scaled by
#: position)
_TEXT_MODEL_TYPES = ("mistral", "llama", "ministral3")


class Mistral3ForConditionalGeneration(TextOnlyWeights, Ministral3ForCausalLM):
    """``Mistral3ForConditionalGeneration`` checkpoints served as text only.

    The engine builds the Mistral decoder of the checkpoint's ``text_config`` (a ``mistral``
    config; its ``sliding_window``, null in the released ones, is honoured as
    :class:`LlamaForCausalLM` honours Mistral's). Hub files name the language model
    ``language_model.model.*`` and ``language_model.lm_head.*`` (transformers 5 still writes
    them so); its in-memory layout, ``model.language_model.*`` and ``lm_head.*``, is read too.
    The Pixtral vision tower and the projector are never read. The LM head is tied only when
    the text config says so (transformers 5.24's ``Mistral3Config`` defaults its own flag to
    true; the text config is the one that describes the language model's weights).

    A ``ministral3`` text config (Ministral 3, late 2025) gets Ministral 3's decoder: its
    queries scaled by position after RoPE
    (:class:`~chassis.builtin_plugins.models.ministral3.Ministral3ForCausalLM`).
    """

    language_model_prefixes = (
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "model."),
    )
    vision_prefixes = (
        "vision_tower.",
        "multi_modal_projector.",
        "model.vision_tower.",
        "model.multi_modal_projector.",
    )

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in _TEXT_MODEL_TYPES:
            raise ValueError(
                f"Mistral3ForConditionalGeneration with a {model_type!r} text_config is not "
                f"supported (only {', '.join(_TEXT_MODEL_TYPES)})"
            )
        return super().decoder_spec(hf_config)
