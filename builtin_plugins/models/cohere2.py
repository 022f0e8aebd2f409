"""Cohere2 (Command R7B): attention and MLP in parallel off one LayerNorm, RoPE only on the
sliding-window layers, and in the interleaved layout; scaled logits.

As HF transformers' ``Cohere2`` code defines it, a layer is::

    x = input_layernorm(h)
    h = h + o_proj(attn(x)) + mlp(x)

and it differs from Llama in:

- one norm per layer, shared by attention and the (SwiGLU) MLP, which run side by side on
  its output (:class:`Cohere2DecoderLayer`); no ``post_attention_layernorm``;
- the norms (each layer's and the final one) are a LayerNorm without bias: mean and
  variance in float32, the weight applied in float32, one cast back
  (:class:`Cohere2LayerNorm`, over ``layer_norm_eps``);
- ``layer_types`` marks each layer ``sliding_attention`` (a window of ``sliding_window``
  positions *and* RoPE) or ``full_attention`` (all positions, *no* positional encoding at
  all); by default three sliding layers, then one full;
- RoPE rotates interleaved pairs ``(2i, 2i + 1)`` of each head (GPT-J layout), not Llama's
  halves ``(i, i + D/2)`` (:func:`rotate_cohere`), in float32 with the tables rounded to
  the model dtype first, as HF does;
- the logits are multiplied by ``logit_scale`` (in the model dtype, where HF multiplies);
- the LM head is tied to the embedding unless ``tie_word_embeddings`` is false.

Projections, merged ``qkv_proj``/``gate_up_proj``, checkpoint names and tensor-parallel
sharding are :class:`LlamaForCausalLM`'s (``attention_bias`` on q/k/v/o is honoured; the
MLP has no bias); the norms are whole on every rank. Attention and the MLP each sum their
partial outputs over the group.
"""

from __future__ import annotations

from typing import Any

import torch

from chassis.builtin_plugins.models.llama import (
    DecoderSpec,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaModel,
)
from chassis.core import parallel_state
from chassis.core.attention import ForwardContext
from chassis.core.layers.norm import RMSNorm
from chassis.core.layers.rotary import RotaryEmbedding, rotate_interleaved
from chassis.core.layers.vocab_parallel import gather_logits
from chassis.core.model_interface import ModelBuildContext

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
#: a default layer pattern: every 4th layer is full attention, the others slide
_DEFAULT_PATTERN = 4


class Cohere2LayerNorm(RMSNorm):
    """HF's ``Cohere2LayerNorm``: ``weight * (x - mean) / sqrt(var + eps)`` over the last
    dimension, no bias, all in float32 and cast to the input dtype once.

    Called as :class:`RMSNorm` is, so that the Llama decoder can use it: ``norm(x)`` and
    ``norm(x, residual)`` returning ``(norm(x + residual), x + residual)``, the sum in the
    input dtype. Only the calls are shared: it always runs this torch code (the platforms'
    ``rms_norm`` kernels compute RMSNorm's formula).
    """

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        centered = x32 - x32.mean(-1, keepdim=True)
        variance = centered.pow(2).mean(-1, keepdim=True)
        return (self.weight.float() * (centered * torch.rsqrt(variance + self.eps))).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # never the platform kernel: it would compute RMSNorm's formula
        return self.forward_reference(x, residual)


def rotate_cohere(
    rotary_emb: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """``x [T, H, D]`` rotated by ``positions [T]`` with pairs ``(2i, 2i + 1)`` turning by
    ``rotary_emb``'s angle ``i`` (its ``cos_cache``/``sin_cache`` tables, ``[max_pos, D/2]``).

    HF's order: the tables rounded to ``x``'s dtype, then ``x * cos + rot(x) * sin`` in
    float32 (:func:`~chassis.core.layers.rotary.rotate_interleaved`), cast back once.
    """
    cos = rotary_emb.cos_cache[positions].to(x.dtype).float().unsqueeze(1)
    sin = rotary_emb.sin_cache[positions].to(x.dtype).float().unsqueeze(1)
    return rotate_interleaved(x.float(), cos, sin).to(x.dtype)


class Cohere2Attention(LlamaAttention):
    """:class:`LlamaAttention` with interleaved RoPE on a sliding layer and none on a full
    one; the window is the layer's (``spec.attention_window``)."""

    def __init__(
        self,
        spec: DecoderSpec,
        rotary_emb: RotaryEmbedding,
        layer_idx: int,
        build_ctx: ModelBuildContext,
        *,
        use_rope: bool,
    ) -> None:
        super().__init__(
            spec,
            rotary_emb,
            layer_idx,
            build_ctx,
            sliding_window=spec.attention_window(layer_idx, build_ctx.max_model_len),
        )
        #: whether this layer rotates q and k (HF: exactly its ``sliding_attention`` layers,
        #: even when a window no sequence outgrows is dropped)
        self.use_rope = use_rope

    def encode_positions(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.use_rope:  # a full layer: no positional encoding at all
            return q, k
        return rotate_cohere(self.rotary_emb, positions, q), rotate_cohere(
            self.rotary_emb, positions, k
        )


class Cohere2DecoderLayer(torch.nn.Module):
    """One :class:`Cohere2LayerNorm` whose output feeds attention and the MLP side by side;
    called as :class:`~chassis.builtin_plugins.models.llama.LlamaDecoderLayer` is, the
    previous layer's residual add fused into the norm."""

    def __init__(
        self,
        spec: DecoderSpec,
        rotary_emb: RotaryEmbedding,
        layer_idx: int,
        build_ctx: ModelBuildContext,
        mlp: torch.nn.Module,
        *,
        use_rope: bool,
    ) -> None:
        super().__init__()
        self.self_attn = Cohere2Attention(spec, rotary_emb, layer_idx, build_ctx, use_rope=use_rope)
        #: ``[T, hidden] -> [T, hidden]``, already summed over a tensor-parallel group
        self.mlp = mlp
        self.input_layernorm = Cohere2LayerNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(mlp output, residual stream + attention output)``; their sum is the
        layer's output, added in HF's order (``(h + attn) + mlp``, so 16-bit sums round as
        HF's do)."""
        if residual is None:
            residual = hidden_states
            normed = self.input_layernorm(hidden_states)
        else:
            normed, residual = self.input_layernorm(hidden_states, residual)
        residual = residual + self.self_attn(positions, normed, ctx)
        return self.mlp(normed), residual


def cohere2_layer_types(hf_config: Any) -> tuple[str, ...]:
    """``config.layer_types`` (without it: every ``sliding_window_pattern``-th layer full,
    the others sliding, as ``Cohere2Config`` derives it); a ``ValueError`` for another
    length or another layer type."""
    num_layers = int(hf_config.num_hidden_layers)
    layer_types = getattr(hf_config, "layer_types", None)
    if not layer_types:
        pattern = int(getattr(hf_config, "sliding_window_pattern", None) or _DEFAULT_PATTERN)
        layer_types = [
            SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)
        ]
    layer_types = tuple(layer_types)
    if len(layer_types) != num_layers:
        raise ValueError(
            f"config layer_types has {len(layer_types)} entries for {num_layers} layers "
            "(num_hidden_layers); fix config.json"
        )
    unknown = sorted(set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown:
        raise ValueError(
            f"config layer_types has {unknown}; Cohere2 implements "
            f"{FULL_ATTENTION!r} and {SLIDING_ATTENTION!r}"
        )
    return layer_types


class Cohere2ForCausalLM(LlamaForCausalLM):
    """``Cohere2ForCausalLM`` checkpoints (c4ai-command-r7b-12-2024 and its fine-tunes).

    Builds :class:`Cohere2DecoderLayer` s with Llama's SwiGLU MLP and a
    :class:`Cohere2LayerNorm` as the final norm; ``logit_scale`` (kept as
    ``self.logit_scale``) multiplies the logits. Refused at build: a ``hidden_act`` other
    than ``silu``, a ``rope_type`` the rotary tables do not implement, a
    ``partial_rotary_factor`` below 1 (HF's Cohere2 rotates whole heads), ``layer_types``
    of another kind, and sliding layers without a positive ``sliding_window``.
    """

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        """Llama's fields with ``layer_norm_eps`` as the norms' eps, no MLP bias, and the
        window on the layers :func:`cohere2_layer_types` marks ``sliding_attention``."""
        layer_types = cohere2_layer_types(hf_config)
        sliding_layers = frozenset(
            i for i, kind in enumerate(layer_types) if kind == SLIDING_ATTENTION
        )
        window = getattr(hf_config, "sliding_window", None)
        if sliding_layers and not (isinstance(window, int) and window >= 1):
            raise ValueError(
                "config layer_types has sliding_attention layers but config sliding_window "
                f"is {window!r}; it must be a positive integer"
            )
        spec = DecoderSpec.from_config(
            hf_config,
            rms_norm_eps=float(getattr(hf_config, "layer_norm_eps", 1e-5)),
            mlp_bias=False,
            sliding_layers=sliding_layers,
        )
        partial = spec.rope.get("partial_rotary_factor")
        if partial is not None and float(partial) != 1.0:
            raise ValueError(
                f"partial_rotary_factor {partial} is not supported for Cohere2 (its RoPE "
                "rotates whole heads)"
            )
        return spec

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> LlamaModel:
        self.layer_types = cohere2_layer_types(hf_config)
        self.logit_scale = float(getattr(hf_config, "logit_scale", 1.0))
        return LlamaModel(
            hf_config, self.spec, build_ctx, self.make_layer, norm_class=Cohere2LayerNorm
        )

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> Cohere2DecoderLayer:
        return Cohere2DecoderLayer(
            self.spec,
            rotary_emb,
            layer_idx,
            build_ctx,
            self.make_mlp(layer_idx),
            use_rope=self.layer_types[layer_idx] == SLIDING_ATTENTION,
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """As :meth:`LlamaForCausalLM.compute_logits`, multiplied by ``logit_scale`` in the
        model dtype (where HF multiplies, so 16-bit logits round as HF's do)."""
        logits = self.lm_head(hidden_states) * self.logit_scale
        if parallel_state.tp_size() > 1:
            logits = gather_logits(logits, self.vocab_size)
        return logits.float()
