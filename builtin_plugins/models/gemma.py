"""Gemma decoder (Gemma 1, and through :class:`GemmaOptions` Gemma 2 and Gemma 3 text).

It reuses the Llama pieces (merged QKV and gate/up projections, :class:`LlamaAttention`,
tensor-parallel sharding and :meth:`LlamaForCausalLM.load_weights`) and changes what Gemma
changes, as HF transformers defines it:

- :class:`~chassis.core.layers.norm.GemmaRMSNorm` everywhere: ``(1 + weight)`` scale, all
  in float32, cast once;
- embeddings multiplied by ``sqrt(hidden_size)`` rounded to the model dtype;
- a GeGLU MLP (``gelu`` with the tanh approximation, gated by ``up``);
- ``head_dim`` from the config and an attention scale from the options.

Gemma 2/3 add (:mod:`.gemma2`, :mod:`.gemma3`): four norms per layer ("sandwich" norms
around attention and the MLP), sliding-window attention on the layers ``config.layer_types``
marks ``sliding_attention``, attention and final logit soft caps, and (Gemma 3) a per-head
q/k norm and RoPE parameters per layer type.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from chassis.builtin_plugins.models.llama import (
    DecoderSpec,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    head_dim_of,
)
from chassis.core.attention import ForwardContext
from chassis.core.layers.activation import GELU_APPROXIMATIONS, GeluAndMul
from chassis.core.layers.norm import GemmaRMSNorm
from chassis.core.layers.rotary import RotaryEmbedding, rope_parameters
from chassis.core.model_interface import ModelBuildContext

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
#: the ``config.layer_types`` values the Gemma decoder implements
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


@dataclass(frozen=True)
class GemmaOptions:
    """What a Gemma generation adds to :class:`DecoderSpec`, read from the HF config."""

    #: ``F.gelu``'s ``approximate`` for the MLP gate ("tanh" for ``gelu_pytorch_tanh``)
    gelu_approximate: str
    #: multiplies ``q . k`` (Gemma: ``head_dim ** -0.5``; 2/3: ``query_pre_attn_scalar ** -0.5``)
    attn_scale: float
    #: each layer's attention kind, one of :data:`LAYER_TYPES`
    layer_types: tuple[str, ...]
    #: RoPE parameters (:func:`rope_parameters` form) of each layer type in ``layer_types``
    rope_by_layer_type: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: ``cap * tanh(score / cap)`` on attention scores (Gemma 2's ``attn_logit_softcapping``)
    attn_logit_softcap: float | None = None
    #: ``cap * tanh(logit / cap)`` on the output logits (``final_logit_softcapping``)
    final_logit_softcap: float | None = None
    #: Gemma 2/3: a norm after attention and norms before and after the MLP
    sandwich_norms: bool = False
    #: Gemma 3: a :class:`GemmaRMSNorm` over each q and k head before RoPE
    qk_norm: bool = False

    def __post_init__(self) -> None:
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(
                f"config.layer_types has {unknown}; the Gemma decoder implements "
                f"{', '.join(LAYER_TYPES)}"
            )
        missing = sorted(set(self.layer_types) - set(self.rope_by_layer_type))
        if missing:
            raise ValueError(f"no RoPE parameters for the layer types {missing}")


#: Gemma 1's released configs name its activation ``gelu``, a legacy value for the tanh form
#: the models were trained with. transformers 5.24 rewrites it in ``GemmaConfig`` (so the
#: config chassis reads says ``gelu_pytorch_tanh``); 5.17, the H200 image's, keeps ``gelu``
#: and runs the exact form. Gemma 1 reads it as tanh under either.
GEMMA1_LEGACY_ACTIVATIONS = {"gelu": "gelu_pytorch_tanh"}


def gelu_approximate(activation: str | None) -> str:
    """``F.gelu``'s ``approximate`` for an HF activation name; a ``ValueError`` otherwise."""
    if activation not in GELU_APPROXIMATIONS:
        raise ValueError(
            f"Gemma MLP activation {activation!r} is not supported; supported: "
            f"{', '.join(GELU_APPROXIMATIONS)}"
        )
    return GELU_APPROXIMATIONS[activation]


def layer_types_of(hf_config: Any, default: Sequence[str]) -> tuple[str, ...]:
    """``config.layer_types`` (``default`` when the config has none), one per layer."""
    layer_types = tuple(getattr(hf_config, "layer_types", None) or default)
    num_layers = int(hf_config.num_hidden_layers)
    if len(layer_types) != num_layers:
        raise ValueError(
            f"config.layer_types has {len(layer_types)} entries for {num_layers} layers"
        )
    return layer_types


def refuse_bidirectional(hf_config: Any) -> None:
    """A ``ValueError`` for ``use_bidirectional_attention`` (embedding variants): this decoder
    is causal."""
    if getattr(hf_config, "use_bidirectional_attention", None):
        raise ValueError(
            "use_bidirectional_attention=True (a Gemma embedding model) is not supported: "
            "chassis runs causal decoders only"
        )


class GemmaAttention(LlamaAttention):
    """:class:`LlamaAttention` with Gemma's scale, this layer's window and soft cap, and
    (Gemma 3) :class:`GemmaRMSNorm` q/k norms over each head."""

    def __init__(
        self,
        spec: DecoderSpec,
        options: GemmaOptions,
        rotary_emb: RotaryEmbedding,
        layer_idx: int,
        build_ctx: ModelBuildContext,
    ) -> None:
        super().__init__(
            spec,
            rotary_emb,
            layer_idx,
            build_ctx,
            scale=options.attn_scale,
            sliding_window=spec.attention_window(layer_idx, build_ctx.max_model_len),
            logits_soft_cap=options.attn_logit_softcap,
        )
        # The parent's q/k norms would be Llama's RMSNorm; Gemma's are built here instead
        # (``spec.qk_norm`` is False for Gemma, the option lives in GemmaOptions).
        self.qk_norm = options.qk_norm
        if options.qk_norm:
            self.q_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps)


class GemmaMLP(LlamaMLP):
    """:class:`LlamaMLP` with ``gelu(gate) * up`` (GeGLU) instead of SwiGLU."""

    def __init__(self, spec: DecoderSpec, gelu_approximate: str) -> None:
        super().__init__(spec)
        self.act_fn = GeluAndMul(gelu_approximate)


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Pre-norm attention and MLP blocks with the residual add fused into the norms.

    Gemma: ``input_layernorm`` before attention, ``post_attention_layernorm`` before the MLP
    (Llama's layout and :meth:`LlamaDecoderLayer.forward`). Gemma 2/3 (``sandwich_norms``):
    ``post_attention_layernorm`` normalizes the attention output before the residual add,
    ``pre_feedforward_layernorm`` is the norm before the MLP and
    ``post_feedforward_layernorm`` normalizes the MLP output.
    """

    def __init__(
        self,
        spec: DecoderSpec,
        options: GemmaOptions,
        rotary_emb: RotaryEmbedding,
        layer_idx: int,
        build_ctx: ModelBuildContext,
    ) -> None:
        # attention first, then the MLP: the order their parameters are created in
        self_attn = GemmaAttention(spec, options, rotary_emb, layer_idx, build_ctx)
        super().__init__(
            spec,
            rotary_emb,
            layer_idx,
            build_ctx,
            GemmaMLP(spec, options.gelu_approximate),
            norm_class=GemmaRMSNorm,
            self_attn=self_attn,
        )
        eps = spec.rms_norm_eps
        self.sandwich_norms = options.sandwich_norms
        if options.sandwich_norms:
            self.pre_feedforward_layernorm = GemmaRMSNorm(spec.hidden_size, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(spec.hidden_size, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(block output, residual stream)``; their sum is the layer's output."""
        if not self.sandwich_norms:
            return super().forward(positions, hidden_states, residual, ctx)
        hidden_states, residual = self.attend(positions, hidden_states, residual, ctx)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    """``GemmaForCausalLM`` checkpoints (Gemma 1, CodeGemma); the base of Gemma 2 and 3.

    Subclasses choose the generation's options by overriding :meth:`gemma_options`. Weight
    loading and tensor parallelism are :class:`LlamaForCausalLM`'s (same checkpoint names,
    same sharding; the Gemma norms, q/k norms included, are whole on every rank). The LM
    head is tied to the embedding as ``tie_word_embeddings`` says (true in HF's Gemma
    configs unless ``config.json`` sets it false).
    """

    norm_class = GemmaRMSNorm

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> LlamaModel:
        """Llama's decoder of :class:`GemmaDecoderLayer` layers, with this generation's
        :meth:`gemma_options` (kept as ``self.options``): embeddings scaled by
        ``sqrt(hidden_size)``, a RoPE table per layer type."""
        refuse_bidirectional(hf_config)
        self.options = self.gemma_options(hf_config)
        # HF multiplies by sqrt(hidden_size) as a tensor of the model dtype: in bfloat16
        # sqrt(3072) = 55.43 becomes 55.5, and the checkpoints were trained with that.
        embed_scale = float(
            torch.tensor(self.spec.hidden_size**0.5, dtype=build_ctx.dtype, device="cpu")
        )
        rope = self.options.rope_by_layer_type
        return LlamaModel(
            hf_config,
            self.spec,
            build_ctx,
            self.make_layer,
            norm_class=GemmaRMSNorm,
            embedding_multiplier=embed_scale,
            rope_per_layer=[rope[kind] for kind in self.options.layer_types],
        )

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> GemmaDecoderLayer:
        """A :class:`GemmaDecoderLayer` with this generation's options."""
        return GemmaDecoderLayer(self.spec, self.options, rotary_emb, layer_idx, build_ctx)

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        """Shapes of a Gemma layer (``head_dim`` from the config; biases as
        ``attention_bias`` says; the RoPE field holds the full-attention layers' parameters).
        The layers :meth:`gemma_options` marks ``sliding_attention`` slide over
        ``config.sliding_window`` positions, which must then be a positive integer; as for
        Llama (:func:`config_sliding_window`), a window of at least
        ``max_position_embeddings`` is full attention."""
        options = cls.gemma_options(hf_config)
        sliding_layers = frozenset(
            i for i, kind in enumerate(options.layer_types) if kind == SLIDING_ATTENTION
        )
        window = getattr(hf_config, "sliding_window", None)
        if sliding_layers and not (isinstance(window, int) and window >= 1):
            raise ValueError(
                "config.layer_types has sliding_attention layers but config.sliding_window "
                f"is {window!r}; it must be a positive integer"
            )
        return DecoderSpec.from_config(
            hf_config,
            activation=None,  # Gemma's GeGLU, checked by gemma_options
            rope=options.rope_by_layer_type[FULL_ATTENTION],
            sliding_layers=sliding_layers,
        )

    @classmethod
    def gemma_options(cls, hf_config: Any) -> GemmaOptions:
        """Gemma 1: ``hidden_act`` (the legacy ``gelu`` as the tanh form:
        :data:`GEMMA1_LEGACY_ACTIVATIONS`), ``head_dim ** -0.5``, full attention everywhere."""
        num_layers = int(hf_config.num_hidden_layers)
        activation = getattr(hf_config, "hidden_act", None)
        activation = GEMMA1_LEGACY_ACTIVATIONS.get(activation, activation)
        return GemmaOptions(
            gelu_approximate=gelu_approximate(activation),
            attn_scale=head_dim_of(hf_config) ** -0.5,
            layer_types=(FULL_ATTENTION,) * num_layers,
            rope_by_layer_type={FULL_ATTENTION: rope_parameters(hf_config)},
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """As :meth:`LlamaForCausalLM.compute_logits`, then the final soft cap if configured
        (in float32; HF applies it in the model dtype, the same values in float32)."""
        logits = super().compute_logits(hidden_states)
        cap = self.options.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
