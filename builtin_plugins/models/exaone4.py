"""EXAONE 4.0: OLMo 2's post-norm layers with Qwen3's per-head q/k norms, and hybrid
sliding-window / global attention whose global layers have no RoPE.

As HF transformers' ``Exaone4`` code defines it, what differs from Llama:

- Post-norms, as OLMo 2: no norm before attention or the MLP; each block's output goes
  through its RMSNorm (``post_attention_layernorm``, ``post_feedforward_layernorm``) before
  the residual add.
- ``q_norm``/``k_norm``: an RMSNorm over each head of q and k (weights of ``head_dim``), after
  the projections and before RoPE, as Qwen3.
- ``layer_types`` names each layer ``"sliding_attention"`` or ``"full_attention"`` (HF's
  config derives it from an integer ``sliding_window_pattern``: every that-many-th layer is
  full). Sliding layers see the last ``sliding_window`` positions, their own included.
- When the config has a ``sliding_window``, the full-attention layers skip RoPE (no position
  encoding at all) and only the sliding layers rotate. Without one (EXAONE 4.0 1.2B), every
  layer is full attention with RoPE. One RoPE table (``rope_parameters``, e.g. ``llama3``
  scaling) serves every rotating layer.
- No biases anywhere (HF's projections are bias-free whatever the config says).

Weights, merged projections and tensor parallelism are
:class:`~chassis.builtin_plugins.models.llama.LlamaForCausalLM`'s; the per-head norms are
whole on every rank, as Qwen3's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaAttention, LlamaForCausalLM
from chassis.builtin_plugins.models.olmo2 import Olmo2DecoderLayer, Olmo2Model
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.model_interface import ModelBuildContext

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


def exaone4_layer_types(hf_config: Any) -> tuple[str, ...]:
    """Each layer's attention kind: ``config.layer_types``, else derived as HF's config does
    from an integer ``sliding_window_pattern`` (layer ``i`` is full when ``(i + 1) %
    pattern == 0``; all full without a ``sliding_window``). A ``ValueError`` names the field
    when ``layer_types`` is wrong or cannot be derived."""
    num_layers = int(hf_config.num_hidden_layers)
    layer_types = getattr(hf_config, "layer_types", None)
    if not layer_types:
        pattern = getattr(hf_config, "sliding_window_pattern", None)
        if getattr(hf_config, "sliding_window", None) is None:
            layer_types = [FULL_ATTENTION] * num_layers
        elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
            layer_types = [
                FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION
                for i in range(num_layers)
            ]
        else:
            raise ValueError(
                f"config sliding_window_pattern {pattern!r} without layer_types is not "
                "supported (only a positive integer); add layer_types to config.json"
            )
    layer_types = tuple(layer_types)
    if len(layer_types) != num_layers:
        raise ValueError(
            f"config layer_types has {len(layer_types)} entries for {num_layers} layers "
            "(num_hidden_layers); fix config.json"
        )
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(
            f"config layer_types has unsupported entries {unknown}; supported: "
            f"{', '.join(LAYER_TYPES)}"
        )
    return layer_types


class NoRotaryEmbedding(nn.Module):
    """Stands in for :class:`~chassis.core.layers.rotary.RotaryEmbedding` in a layer without
    position encoding (EXAONE 4.0's global layers): the same call, which applies the per-head
    q/k norms and rotates nothing."""

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        qk_norms: tuple[nn.Module, nn.Module] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if qk_norms is not None:
            query, key = qk_norms[0](query), qk_norms[1](key)
        return query, key


class Exaone4ForCausalLM(LlamaForCausalLM):
    """``Exaone4ForCausalLM`` checkpoints (EXAONE-4.0-1.2B, EXAONE-4.0-32B, EXAONE-4.0.1-32B).

    :class:`~chassis.builtin_plugins.models.olmo2.Olmo2DecoderLayer` s around a
    :class:`~chassis.builtin_plugins.models.llama.LlamaAttention` with per-head q/k norms (and
    :class:`NoRotaryEmbedding` on the global layers of a hybrid config), in an
    :class:`~chassis.builtin_plugins.models.olmo2.Olmo2Model`. Refused when the model is
    built: another ``hidden_act`` than ``silu``, a RoPE type
    :class:`~chassis.core.layers.rotary.RotaryEmbedding` does not implement, ``layer_types``
    entries other than full/sliding attention, and a string ``sliding_window_pattern`` with
    no ``layer_types`` to say what it means.
    """

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        layer_types = exaone4_layer_types(hf_config)
        return DecoderSpec.from_config(
            hf_config,
            qkv_bias=False,
            o_bias=False,
            mlp_bias=False,
            qk_norm=True,
            sliding_layers=frozenset(
                i for i, kind in enumerate(layer_types) if kind == SLIDING_ATTENTION
            ),
        )

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> Olmo2Model:
        # HF rotates a layer when the config has no window at all, or when the layer slides
        # (the raw field: a window that config_sliding_window drops still makes global NoPE)
        hybrid = getattr(hf_config, "sliding_window", None) is not None
        layer_types = exaone4_layer_types(hf_config)
        #: whether each layer applies RoPE
        self.layer_rotates = tuple(not hybrid or kind == SLIDING_ATTENTION for kind in layer_types)
        return Olmo2Model(hf_config, self.spec, build_ctx, self.make_layer)

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> Olmo2DecoderLayer:
        self_attn = LlamaAttention(
            self.spec,
            rotary_emb if self.layer_rotates[layer_idx] else NoRotaryEmbedding(),
            layer_idx,
            build_ctx,
            sliding_window=self.spec.attention_window(layer_idx, build_ctx.max_model_len),
        )
        return Olmo2DecoderLayer(
            self.spec,
            rotary_emb,
            layer_idx,
            build_ctx,
            self.make_mlp(layer_idx),
            self_attn=self_attn,
        )
