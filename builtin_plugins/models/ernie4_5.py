"""ERNIE 4.5 (dense): the Llama decoder with interleaved RoPE in float32 and one bias flag
for every projection.

As HF transformers' ``Ernie4_5`` code defines it, the layer is Llama's (pre-norm RMSNorm,
grouped-query attention, SwiGLU MLP) and what differs is:

- RoPE rotates interleaved pairs ``(2i, 2i + 1)`` of each head (GPT-J layout, "glm rope
  style" in HF's code), not Llama's halves ``(i, i + D/2)``, and it does so in float32: q and
  k are cast up, rotated by the float32 tables (never rounded to the model dtype) and cast
  back once (:func:`rotate_ernie`);
- ``use_bias`` puts a bias on every projection: q, k, v, o, gate, up and down (false in the
  released checkpoints); ``attention_bias``/``mlp_bias`` are not read;
- the LM head is tied to the embedding unless ``tie_word_embeddings`` is false (the config's
  default is tied);
- ``head_dim`` defaults to 128 whatever the hidden size (read from the config as Llama's is);
- no sliding window.

Projections, the merged ``qkv_proj``/``gate_up_proj`` matmuls, checkpoint names and
tensor-parallel sharding are :class:`LlamaForCausalLM`'s; the norms are whole on every
rank.
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
from chassis.core.layers.rotary import RotaryEmbedding, rope_parameters, rotate_interleaved
from chassis.core.model_interface import ModelBuildContext


def rotate_ernie(
    rotary_emb: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """``x [T, H, D]`` rotated by ``positions [T]``, pairs ``(2i, 2i + 1)`` turning by
    ``rotary_emb``'s angle ``i``: HF's ERNIE 4.5 order, ``x`` cast to float32, rotated by the
    float32 tables (:func:`~chassis.core.layers.rotary.rotate_interleaved`) and cast back
    once."""
    cos = rotary_emb.cos_cache[positions].unsqueeze(1)
    sin = rotary_emb.sin_cache[positions].unsqueeze(1)
    return rotate_interleaved(x.float(), cos, sin).to(x.dtype)


class Ernie4_5Attention(LlamaAttention):
    """:class:`LlamaAttention` whose RoPE is :func:`rotate_ernie` (no window)."""

    def encode_positions(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotate_ernie(self.rotary_emb, positions, q), rotate_ernie(
            self.rotary_emb, positions, k
        )


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    """``Ernie4_5ForCausalLM`` checkpoints (baidu/ERNIE-4.5-0.3B-PT and -Base-PT).

    Refused at build, with a ``ValueError`` naming the field: a ``hidden_act`` other than
    ``silu``, a ``rope_type`` the rotary tables do not implement and a
    ``partial_rotary_factor`` below 1 (HF's ERNIE 4.5 rotates whole heads).
    """

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        """Llama's fields with ``use_bias`` on every projection, no window, and the
        interleaved RoPE layout (which :class:`Ernie4_5Attention` applies itself)."""
        rope = rope_parameters(hf_config)
        partial = rope.get("partial_rotary_factor")
        if partial is not None and float(partial) != 1.0:
            raise ValueError(
                f"partial_rotary_factor {partial} is not supported for ERNIE 4.5 (its RoPE "
                "rotates whole heads)"
            )
        use_bias = bool(getattr(hf_config, "use_bias", False))
        return DecoderSpec.from_config(
            hf_config,
            qkv_bias=use_bias,
            o_bias=use_bias,
            mlp_bias=use_bias,
            sliding_window=None,
            rope={**rope, "interleaved": True},
        )

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> LlamaDecoderLayer:
        return LlamaDecoderLayer(
            self.spec,
            rotary_emb,
            layer_idx,
            build_ctx,
            self.make_mlp(layer_idx),
            self_attn=Ernie4_5Attention(self.spec, rotary_emb, layer_idx, build_ctx),
        )
