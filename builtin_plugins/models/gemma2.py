"""Gemma 2: the Gemma decoder with sandwich norms, alternating sliding-window layers and
attention and final logit soft caps."""

from __future__ import annotations

from typing import Any

from chassis.builtin_plugins.models.gemma import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    GemmaForCausalLM,
    GemmaOptions,
    gelu_approximate,
    layer_types_of,
)
from chassis.core.layers.rotary import rope_parameters


def optional_float(value: Any) -> float | None:
    """``None`` stays ``None`` (a cap that is off); anything else becomes a float."""
    return None if value is None else float(value)


class Gemma2ForCausalLM(GemmaForCausalLM):
    """``Gemma2ForCausalLM`` checkpoints (Gemma 2 2B/9B/27B).

    Layers marked ``sliding_attention`` in ``config.layer_types`` (by default every other
    one, starting with the first) attend to the last ``sliding_window`` positions; attention
    scores are soft-capped by ``attn_logit_softcapping`` and logits by
    ``final_logit_softcapping``. Both need an attention backend that supports them (the
    ``torch_paged`` reference does); building the model on one that does not is a
    ``ValueError`` naming the backend.
    """

    @classmethod
    def gemma_options(cls, hf_config: Any) -> GemmaOptions:
        num_layers = int(hf_config.num_hidden_layers)
        default_types = [
            SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers)
        ]
        rope = rope_parameters(hf_config)
        return GemmaOptions(
            gelu_approximate=gelu_approximate(getattr(hf_config, "hidden_activation", None)),
            attn_scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
            layer_types=layer_types_of(hf_config, default_types),
            rope_by_layer_type={FULL_ATTENTION: rope, SLIDING_ATTENTION: rope},
            attn_logit_softcap=optional_float(getattr(hf_config, "attn_logit_softcapping", None)),
            final_logit_softcap=optional_float(getattr(hf_config, "final_logit_softcapping", None)),
            sandwich_norms=True,
        )
