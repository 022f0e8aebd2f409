"""LiquidAI LFM2 (``Lfm2ForCausalLM``: LFM2-350M/700M/1.2B/2.6B): gated short-convolution
layers and a few attention layers.

As HF transformers' ``Lfm2`` code defines it:

- ``layer_types`` names each layer's mixer: ``"conv"`` (a :class:`~chassis.core.layers.
  short_conv.ShortConv`, window ``conv_L_cache``) or ``"full_attention"`` (GQA with an
  RMSNorm on each q and k head before RoPE). Only the attention layers have a KV cache; the
  conv layers carry a state per request.
- Every layer is pre-norm (``operator_norm``, ``ffn_norm``) with a SwiGLU MLP
  (``feed_forward.w1/w3/w2``) whose width ``block_auto_adjust_ff_dim`` shrinks to two thirds
  of ``intermediate_size`` (times ``block_ffn_dim_multiplier``, rounded up to
  ``block_multiple_of``); the final norm is ``model.embedding_norm``.

The checkpoint's names are renamed onto the Llama decoder's
(:attr:`Lfm2ForCausalLM.checkpoint_renames`), and back for the module names LoRA adapters
use (``feed_forward.w1``, ``self_attn.out_proj``, ``conv.in_proj``). Tensor parallelism
splits the conv layers' channels (:class:`Lfm2ForCausalLM`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.hybrid_layer import HybridDecoderLayer, hybrid_state_specs
from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaAttention, LlamaForCausalLM
from chassis.builtin_plugins.models.parallel_residual import CheckpointRenames
from chassis.core.layers.mamba2_mixer import (
    ShardedMixer,
    mamba2_checkpoint_part,
    mamba2_mixers,
)
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.layers.short_conv import ShortConv
from chassis.core.model_interface import ModelBuildContext
from chassis.core.request_state_cache import RequestStateSpec

_LAYER_KINDS = ("conv", "full_attention")


def lfm2_layer_kinds(hf_config: Any) -> list[str]:
    """``"conv"`` or ``"full_attention"`` per layer (``layer_types``); a ``ValueError`` for
    another value or a wrong count."""
    types = list(getattr(hf_config, "layer_types", None) or [])
    num_layers = int(hf_config.num_hidden_layers)
    if len(types) != num_layers:
        raise ValueError(
            f"config layer_types must name each of the {num_layers} layers' mixer, got {types!r}"
        )
    unknown = sorted({t for t in types if t not in _LAYER_KINDS})
    if unknown:
        raise ValueError(
            f"config layer_types {unknown} not supported (known: {', '.join(_LAYER_KINDS)})"
        )
    return types


def lfm2_mlp_width(hf_config: Any) -> int:
    """The SwiGLU MLP's width, as HF's ``Lfm2MLP`` adjusts ``intermediate_size``."""
    width = int(hf_config.intermediate_size)
    if getattr(hf_config, "block_auto_adjust_ff_dim", False):
        width = int(2 * width / 3)
        multiplier = getattr(hf_config, "block_ffn_dim_multiplier", None)
        if multiplier is not None:
            width = int(multiplier * width)
            multiple = int(hf_config.block_multiple_of)
            width = multiple * ((width + multiple - 1) // multiple)
    return width


class Lfm2DecoderLayer(HybridDecoderLayer):
    """An LFM2 layer: the gated short convolution (``conv``) or attention (``self_attn``)."""

    state_mixer_name = "conv"
    conv: ShortConv | None
    state_mixer_cls = ShortConv


class Lfm2ForCausalLM(CheckpointRenames, LlamaForCausalLM):
    """``Lfm2ForCausalLM`` checkpoints. Attention layer ``j`` (counting attention layers
    only) reads KV cache ``j``; conv layer ``c`` holds request-state tensor ``c``. Refused
    when built: unknown ``layer_types``, a ``conv_L_cache`` below 2.

    Tensor parallel: attention, MLP, embeddings and LM head as Llama's; each short-conv
    layer keeps ``hidden_size / N`` channels (:mod:`~chassis.core.layers.short_conv`) and
    its output is summed over the group."""

    has_recurrent_state = True
    checkpoint_renames = (
        (".self_attn.out_proj.", ".self_attn.o_proj."),
        (".self_attn.q_layernorm.", ".self_attn.q_norm."),
        (".self_attn.k_layernorm.", ".self_attn.k_norm."),
        (".feed_forward.w1.", ".mlp.gate_proj."),
        (".feed_forward.w3.", ".mlp.up_proj."),
        (".feed_forward.w2.", ".mlp.down_proj."),
        (".operator_norm.", ".input_layernorm."),
        (".ffn_norm.", ".post_attention_layernorm."),
        (".model.embedding_norm.", ".model.norm."),
    )

    @classmethod
    def check_tensor_parallel(cls, hf_config: Any, size: int) -> None:
        hidden = int(hf_config.hidden_size)
        if "conv" in lfm2_layer_kinds(hf_config) and hidden % size:
            raise ValueError(
                f"hidden_size ({hidden}) is not divisible by --tensor-parallel-size {size} "
                "(the short-conv layers split their channels)"
            )

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec.from_config(
            hf_config,
            qk_norm=True,
            sliding_window=None,
            rms_norm_eps=float(hf_config.norm_eps),
            intermediate_size=lfm2_mlp_width(hf_config),
        )

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> nn.Module:
        self.layer_kinds = lfm2_layer_kinds(hf_config)
        self.state_dtype = build_ctx.dtype
        return super().build_decoder(hf_config, build_ctx)

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> Lfm2DecoderLayer:
        before = self.layer_kinds[:layer_idx]
        mixer: nn.Module
        if self.layer_kinds[layer_idx] == "conv":
            mixer = ShortConv(
                self.spec.hidden_size,
                int(self.hf_config.conv_L_cache),
                bool(getattr(self.hf_config, "conv_bias", False)),
                state_index=before.count("conv"),
            )
        else:
            mixer = LlamaAttention(self.spec, rotary_emb, before.count("full_attention"), build_ctx)
        return Lfm2DecoderLayer(self.spec, mixer, self.make_mlp(layer_idx))

    @property
    def num_attention_layers(self) -> int:
        return lfm2_layer_kinds(self.hf_config).count("full_attention")

    def request_state_specs(self) -> list[RequestStateSpec]:
        return hybrid_state_specs(self.model.layers, self.state_dtype)

    @functools.cached_property
    def _conv_mixers(self) -> dict[str, ShardedMixer]:
        return mamba2_mixers(self)

    def _tensor_parallel_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """As Llama's, and a short-conv layer's tensors cut by its ``checkpoint_part``."""
        if ".conv." in name:
            return mamba2_checkpoint_part(self._conv_mixers, name, tensor)
        return super()._tensor_parallel_slice(name, tensor)
