"""Hunyuan dense (Tencent Hunyuan-0.5B/1.8B/4B/7B, base and instruct): the Llama decoder
with per-head q/k RMSNorms *after* RoPE and NTK-alpha RoPE scaling.

As HF transformers' ``HunYuanDenseV1`` code defines it, what differs from Llama:

- ``query_layernorm``/``key_layernorm``: an RMSNorm over each head of q and k (weights of
  ``head_dim``), applied to the *rotated* q and k (Qwen3 and the others normalize before
  RoPE), :class:`HunYuanAttention`;
- the checkpoints' RoPE scaling is ``{"type": "dynamic", "alpha": A, ...}``: with an
  ``alpha`` HF's Hunyuan computes no dynamic (length-dependent) scaling but a fixed table
  whose base is raised to ``rope_theta * A ** (head_dim / (head_dim - 2))`` (it renames the
  type ``ntk_alpha``; :func:`~chassis.core.layers.rotary.ntk_alpha_base`), here as well.
  ``factor``, ``mscale`` and the like in that dict are ignored, as HF ignores them.
  ``dynamic`` without ``alpha`` is HF's sequence-length-dependent NTK scaling, which a paged
  cache cannot reproduce: refused;
- ``attention_bias`` puts a bias on q, k, v and o; the MLP never has one;
- no sliding window.

Projections, the merged ``qkv_proj``/``gate_up_proj`` matmuls, checkpoint names and
tensor-parallel sharding are :class:`LlamaForCausalLM`'s; the per-head norms, like the
layer norms, are whole on every rank.
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
from chassis.core.layers.norm import RMSNorm
from chassis.core.layers.rotary import RotaryEmbedding, rope_parameters
from chassis.core.model_interface import ModelBuildContext


def hunyuan_rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The config's RoPE parameters, ``dynamic`` with an ``alpha`` read as ``ntk_alpha``
    (as HF's Hunyuan reads it); ``ValueError`` for ``dynamic`` without one and for a
    ``partial_rotary_factor`` below 1 (HF's Hunyuan rotates whole heads)."""
    rope = rope_parameters(hf_config)
    partial = rope.get("partial_rotary_factor")
    if partial is not None and float(partial) != 1.0:
        raise ValueError(
            f"partial_rotary_factor {partial} is not supported for Hunyuan (its RoPE rotates "
            "whole heads)"
        )
    if rope["rope_type"] == "dynamic":
        if not rope.get("alpha"):
            raise ValueError(
                "rope_type 'dynamic' without alpha (dynamic NTK scaling, which changes with "
                "the sequence length) is not supported for Hunyuan; only the checkpoints' "
                "fixed-alpha NTK scaling is"
            )
        rope = {"rope_type": "ntk_alpha", "rope_theta": rope["rope_theta"], "alpha": rope["alpha"]}
    return rope


class HunYuanAttention(LlamaAttention):
    """:class:`LlamaAttention` with per-head ``query_layernorm``/``key_layernorm`` applied
    after RoPE (no window)."""

    def __init__(
        self,
        spec: DecoderSpec,
        rotary_emb: RotaryEmbedding,
        layer_idx: int,
        build_ctx: ModelBuildContext,
    ) -> None:
        super().__init__(spec, rotary_emb, layer_idx, build_ctx)
        self.query_layernorm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.key_layernorm = RMSNorm(spec.head_dim, spec.rms_norm_eps)

    def encode_positions(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = self.rotary_emb(positions, q, k)
        # the per-head norms after RoPE (Qwen3 and Llama's qk_norm put them before)
        return self.query_layernorm(q), self.key_layernorm(k)


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    """``HunYuanDenseV1ForCausalLM`` checkpoints (tencent/Hunyuan-0.5B/1.8B/4B/7B, -Pretrain
    and -Instruct).

    Refused at build, with a ``ValueError`` naming the field: a ``hidden_act`` other than
    ``silu``; a ``rope_type`` the rotary tables do not implement, ``dynamic`` without
    ``alpha`` included; a ``partial_rotary_factor`` below 1; and the original configs'
    switches for what HF's model does not have: ``use_qk_norm`` false (HF always normalizes),
    ``use_cla`` true (cross-layer attention) and ``use_rotary_pos_emb`` false.
    """

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        for field, unsupported in (
            ("use_qk_norm", False),
            ("use_cla", True),
            ("use_rotary_pos_emb", False),
        ):
            value = getattr(hf_config, field, None)
            if value is not None and bool(value) == unsupported:
                raise ValueError(
                    f"config {field} {value!r} is not supported for Hunyuan (HF's "
                    "HunYuanDenseV1 implements only the released checkpoints' layout)"
                )
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderSpec.from_config(
            hf_config,
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=False,
            sliding_window=None,
            rope=hunyuan_rope_parameters(hf_config),
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
            self_attn=HunYuanAttention(self.spec, rotary_emb, layer_idx, build_ctx),
        )
