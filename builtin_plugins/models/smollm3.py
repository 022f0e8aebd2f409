"""SmolLM3: the Llama decoder with RoPE left out of some layers (NoPE layers).

As HF transformers' ``SmolLM3`` code defines it, every layer is Llama's (pre-norm RMSNorm,
SwiGLU, grouped-query attention, ``attention_bias``/``mlp_bias`` as configured) except:

- ``no_rope_layers[i]`` says whether layer ``i`` rotates q and k: ``1`` applies RoPE, ``0``
  leaves it out (a NoPE layer: its attention sees no positions but through causality). A
  config without the list gets HF's default, a NoPE layer every ``no_rope_layer_interval``
  layers (the layers ``i`` with ``(i + 1) % interval == 0``);
- with ``use_sliding_window: true`` and a ``sliding_window``, the layers ``layer_types``
  marks ``sliding_attention`` attend over that window. A config without ``layer_types``
  gets HF's default, where the NoPE layers are the sliding ones.

SmolLM3-3B has no sliding layers. Its default RoPE base is 2,000,000 (read from the config).
Weight loading, the merged ``qkv_proj``/``gate_up_proj`` matmuls and the tensor-parallel
sharding are :class:`LlamaForCausalLM`'s: a NoPE layer has the same weights as another.
"""

from __future__ import annotations

from typing import Any

import torch

from chassis.builtin_plugins.models.llama import (
    DecoderSpec,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    qwen_sliding_layers,
)
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.model_interface import ModelBuildContext

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
#: HF's ``no_rope_layer_interval`` when the config has none
_DEFAULT_NO_ROPE_INTERVAL = 4


def rope_layers(hf_config: Any) -> tuple[bool, ...]:
    """Whether each decoder layer applies RoPE, from ``no_rope_layers`` (``1``: RoPE, ``0``:
    none) or, without it, HF's default of a NoPE layer every ``no_rope_layer_interval``.

    ``ValueError`` for a list shorter than ``num_hidden_layers`` (HF reads entry ``i`` for
    layer ``i``; longer lists are fine), an entry other than 0 or 1, or an interval below 1.
    """
    num_layers = int(hf_config.num_hidden_layers)
    flags = getattr(hf_config, "no_rope_layers", None)
    if flags is None:
        interval = getattr(hf_config, "no_rope_layer_interval", None)
        interval = _DEFAULT_NO_ROPE_INTERVAL if interval is None else interval
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ValueError(
                f"config no_rope_layer_interval must be a positive integer, got {interval!r}"
            )
        return tuple((i + 1) % interval != 0 for i in range(num_layers))
    flags = list(flags)
    if len(flags) < num_layers:
        raise ValueError(
            f"config no_rope_layers has {len(flags)} entries for {num_layers} layers "
            "(num_hidden_layers); fix config.json"
        )
    bad = [flag for flag in flags[:num_layers] if flag not in (0, 1)]
    if bad:
        raise ValueError(
            f"config no_rope_layers entries must be 1 (RoPE) or 0 (no RoPE), got {bad[0]!r}"
        )
    return tuple(bool(flag) for flag in flags[:num_layers])


def smollm3_sliding_layers(hf_config: Any) -> frozenset[int]:
    """The layers that slide: those ``layer_types`` marks ``sliding_attention`` or, without
    ``layer_types``, HF's default (the NoPE layers, when ``use_sliding_window`` is on and a
    ``sliding_window`` is set; else none).

    ``ValueError`` for a ``layer_types`` entry other than ``full_attention`` and
    ``sliding_attention``, and for sliding layers without ``use_sliding_window: true`` and a
    ``sliding_window``: HF's attention then reads no window while its mask has one (or
    fails), so there is no one answer to match.
    """
    use_window = getattr(hf_config, "use_sliding_window", None) is True
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types:
        unknown = sorted(set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if unknown:
            raise ValueError(
                f"config layer_types has {unknown[0]!r}; SmolLM3 layers are "
                f"{FULL_ATTENTION!r} or {SLIDING_ATTENTION!r}"
            )
    with_rope = rope_layers(hf_config)
    sliding = qwen_sliding_layers(
        hf_config, lambda i: use_window and bool(window) and not with_rope[i]
    )
    if sliding and not (use_window and window):
        raise ValueError(
            "config layer_types marks sliding_attention layers, but use_sliding_window is "
            f"{getattr(hf_config, 'use_sliding_window', None)!r} and sliding_window is "
            f"{window!r}: set use_sliding_window to true and a sliding_window, or mark every "
            "layer full_attention"
        )
    return sliding


class SmolLM3Attention(LlamaAttention):
    """:class:`LlamaAttention` that rotates q and k only when ``use_rope`` (a NoPE layer
    passes them to attention as projected)."""

    def __init__(
        self,
        spec: DecoderSpec,
        rotary_emb: RotaryEmbedding,
        layer_idx: int,
        build_ctx: ModelBuildContext,
        *,
        use_rope: bool,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__(spec, rotary_emb, layer_idx, build_ctx, sliding_window=sliding_window)
        self.use_rope = use_rope

    def encode_positions(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # a NoPE layer attends to q and k as projected
        return super().encode_positions(positions, q, k) if self.use_rope else (q, k)

    def extra_repr(self) -> str:
        return f"use_rope={self.use_rope}"


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """``SmolLM3ForCausalLM`` checkpoints (SmolLM3-3B, base and instruct).

    ``self.rope_layers`` holds each layer's RoPE flag (:func:`rope_layers`); which layers
    slide is :func:`smollm3_sliding_layers`'. The activation must be ``silu``.
    """

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec.from_config(hf_config, sliding_layers=smollm3_sliding_layers(hf_config))

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> LlamaModel:
        self.rope_layers = rope_layers(hf_config)
        return super().build_decoder(hf_config, build_ctx)

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> LlamaDecoderLayer:
        self_attn = SmolLM3Attention(
            self.spec,
            rotary_emb,
            layer_idx,
            build_ctx,
            use_rope=self.rope_layers[layer_idx],
            sliding_window=self.spec.attention_window(layer_idx, build_ctx.max_model_len),
        )
        return LlamaDecoderLayer(
            self.spec,
            rotary_emb,
            layer_idx,
            build_ctx,
            self.make_mlp(layer_idx),
            norm_class=self.norm_class,
            self_attn=self_attn,
        )
