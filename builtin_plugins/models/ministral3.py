"""Ministral 3 (``Ministral3ForCausalLM``; the language model of Mistral's late-2025
``Mistral3ForConditionalGeneration`` checkpoints): the Mistral decoder whose queries are
scaled by position after RoPE.

HF's ``Ministral3Attention`` multiplies each query, after the rotation, by Llama 4's
attention temperature::

    scale(p) = 1 + llama_4_scaling_beta * log(1 + floor(p / original_max_position_embeddings))

(both read from ``rope_parameters``; ``p`` the token's position). The scale is 1 for every
position below ``original_max_position_embeddings`` and grows by steps past it, so long
contexts keep their attention sharp. Keys and values are not scaled: the KV cache holds what
it holds for Mistral, and the query scale is a per-token factor applied before attention, so
any attention backend runs it. Everything else (YaRN RoPE, as the released configs name it;
the optional sliding window; the SwiGLU MLP) is Mistral's, as
:class:`~.llama.LlamaForCausalLM` serves it.
"""

from __future__ import annotations

from typing import Any

import torch

from chassis.builtin_plugins.models.llama import (
    DecoderSpec,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
)
from chassis.core.layers.rotary import RotaryEmbedding, rope_parameters
from chassis.core.model_interface import ModelBuildContext


def llama_4_query_scaling(hf_config: Any) -> tuple[float, int] | None:
    """``(beta, original_max_position_embeddings)`` of a ``ministral3`` config's query
    scaling; ``None`` for other configs (Mistral's, which HF does not scale) and for a
    ``ministral3`` one whose beta is absent or 0 (the scale is 1 everywhere)."""
    if getattr(hf_config, "model_type", None) != "ministral3":
        return None
    params = rope_parameters(hf_config)
    beta = params.get("llama_4_scaling_beta")
    if not beta:
        return None
    original_max = params.get("original_max_position_embeddings")
    if not isinstance(original_max, int) or original_max <= 0:
        raise ValueError(
            "a ministral3 config with llama_4_scaling_beta needs a positive "
            f"rope_parameters.original_max_position_embeddings; got {original_max!r}"
        )
    return float(beta), original_max


class Llama4ScaledAttention(LlamaAttention):
    """:class:`~.llama.LlamaAttention` whose queries are multiplied, after RoPE, by
    ``1 + beta * log(1 + floor(position / original_max))`` (computed in float32 and cast to
    the queries' dtype, as HF does)."""

    def __init__(self, *args: Any, beta: float, original_max: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.beta = beta
        self.original_max = original_max

    def encode_positions(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = super().encode_positions(positions, q, k)
        return q * self.query_scale(positions).to(q.dtype)[:, None, None], k

    def query_scale(self, positions: torch.Tensor) -> torch.Tensor:
        """``[T]`` float32 factors of the tokens at ``positions``."""
        blocks = torch.floor(positions.to(torch.float32) / self.original_max)
        return 1.0 + self.beta * torch.log1p(blocks)

    def extra_repr(self) -> str:
        return f"llama_4_scaling_beta={self.beta}, original_max={self.original_max}"


class Ministral3ForCausalLM(LlamaForCausalLM):
    """``Ministral3ForCausalLM`` checkpoints, and the base of the ``ministral3`` language
    models inside ``Mistral3ForConditionalGeneration`` (the module docstring). A config of
    another ``model_type`` (``mistral``, ``llama``) gets the plain Llama/Mistral layers."""

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        llama_4_query_scaling(hf_config)  # a ValueError for an unusable config, up front
        return super().decoder_spec(hf_config)

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> LlamaDecoderLayer:
        scaling = llama_4_query_scaling(self.hf_config)
        if scaling is None:
            return super().make_layer(layer_idx, rotary_emb, build_ctx)
        beta, original_max = scaling
        attention = Llama4ScaledAttention(
            self.spec,
            rotary_emb,
            layer_idx,
            build_ctx,
            sliding_window=self.spec.attention_window(layer_idx, build_ctx.max_model_len),
            beta=beta,
            original_max=original_max,
        )
        return LlamaDecoderLayer(
            self.spec,
            rotary_emb,
            layer_idx,
            build_ctx,
            self.make_mlp(layer_idx),
            norm_class=self.norm_class,
            self_attn=attention,
        )
