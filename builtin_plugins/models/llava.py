"""LLaVA-style multimodal checkpoints (LLaVA-1.5, LLaVA-NeXT, InternVL in transformers'
format, Aya Vision): their language model, whatever its architecture, served as text only.

The classes registered for these architectures take images (:mod:`.llava_images`,
:mod:`.llava_next_images`, :mod:`.internvl_images`, :mod:`.aya_vision_images`) and build on
this module's: it is their text side, and what they fall back to for a checkpoint whose
vision tower is not built here (served as text only, with a warning).

These checkpoints put a vision tower and a projector before an unchanged text decoder: the
text model is the one ``text_config.model_type`` names (Llama, Mistral, Vicuna for LLaVA-1.5;
Qwen2 / Qwen3 for InternVL3 / 3.5; Cohere2 for Aya Vision), with 1D positions.
:class:`LlavaForConditionalGeneration` picks chassis' registered
decoder for that text architecture (transformers' causal-LM class for the ``model_type``,
looked up in the model registry) and builds the two as one class
(:meth:`~chassis.core.model_interface.CausalLM.class_for_config`): the decoder's layers,
options and tensor parallelism, with the checkpoint's language-model tensors renamed to it
and the image side never read (:class:`~.text_only.TextOnlyWeights`).
"""

from __future__ import annotations

import functools
from typing import Any

from chassis.builtin_plugins.models.text_only import TextOnlyWeights, wrapper_tie_word_embeddings
from chassis.core.model_interface import CausalLM


class LlavaForConditionalGeneration(TextOnlyWeights, CausalLM):
    """``LlavaForConditionalGeneration``, ``LlavaNextForConditionalGeneration``,
    ``InternVLForConditionalGeneration`` and ``AyaVisionForConditionalGeneration``
    checkpoints served as text only (the module docstring).

    Not built itself: :meth:`class_for_config` returns the class of this one over the text
    config's decoder. Hub files name the language model ``language_model.model.*`` and
    ``language_model.lm_head.*``; transformers 5's layout, ``model.language_model.*`` and
    ``lm_head.*``, is read too. The vision tower, the projector and LLaVA-NeXT's
    ``image_newline`` are never read. The LM head is tied by the checkpoint's top-level
    ``tie_word_embeddings``, as transformers ties it.

    The logits are the LM head's, as transformers' LLaVA classes compute them with their own
    head: over a Granite text model (granite-vision) they are not divided by
    ``logits_scaling``, which only ``GraniteForCausalLM``'s head applies (vLLM's LLaVA calls
    the text model's ``compute_logits`` and divides; transformers is the bar here). Other
    decoders' heads are kept as they are (Cohere2's ``logit_scale``: Aya Vision).
    """

    #: transformers' LLaVA head does not divide by Granite's ``logits_scaling`` (granite.py)
    applies_logits_scaling = False

    language_model_prefixes = (
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "model."),
    )
    vision_prefixes = (
        "vision_tower.",
        "multi_modal_projector.",
        "image_newline",
        "model.vision_tower.",
        "model.multi_modal_projector.",
        "model.image_newline",
    )

    @classmethod
    def class_for_config(cls, hf_config: Any) -> type[CausalLM]:
        """This class over the registered decoder of the text config's architecture; a
        ``ValueError`` when chassis has none for it."""
        if cls.__dict__.get("decoder") is not None:
            return cls  # already composed
        return _over_decoder(cls, text_decoder_class(hf_config))

    #: the text decoder class this one is composed over (set on the composed classes)
    decoder: type[CausalLM] | None = None

    def build_head(self, hf_config: Any) -> None:
        super().build_head(wrapper_tie_word_embeddings(hf_config))  # type: ignore[misc]


class AyaVisionForConditionalGeneration(LlavaForConditionalGeneration):
    """``AyaVisionForConditionalGeneration`` (Aya Vision 8B/32B; Cohere2 text): as
    :class:`LlavaForConditionalGeneration`, the text decoder's logits kept as they are, so
    Cohere2's ``logit_scale`` multiplies them (as in ``Cohere2ForCausalLM``, vLLM and
    transformers from 5.25; transformers before 5.25 left the scale out of Aya Vision's
    logits, which changed logprobs and sampling but never a greedy choice)."""


def text_decoder_class(hf_config: Any) -> type[CausalLM]:
    """chassis' registered class for the text architecture of ``hf_config`` (a multimodal
    checkpoint's text config): the one registered under transformers' causal-LM class name
    for its ``model_type``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from chassis.plugins.registries import get_registries

    model_type = getattr(hf_config, "model_type", None)
    registry = get_registries().models
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    decoder = registry.get(name) if name is not None and name in registry else None
    if decoder is None or issubclass(decoder, TextOnlyWeights):
        wrapper = ", ".join(getattr(hf_config, "architectures", None) or []) or "this checkpoint"
        raise ValueError(
            f"{wrapper} with a {model_type!r} text_config is not supported: chassis has no "
            f"decoder registered for it ({name or 'no causal-LM class in transformers'})"
        )
    return decoder.class_for_config(hf_config)


@functools.cache
def _over_decoder(wrapper: type[CausalLM], decoder: type[CausalLM]) -> type[CausalLM]:
    """``wrapper`` (:class:`LlavaForConditionalGeneration` or a subclass) mixed into
    ``decoder``: one class per pair, so every rank and every lookup gets the same."""
    name = f"{wrapper.__name__}Over{decoder.__name__}"
    return type(name, (wrapper, decoder), {"__module__": __name__, "decoder": decoder})
