"""IBM Granite (3.0-3.3 dense): the Llama decoder with four scalar multipliers.

As HF transformers' ``Granite`` code defines them (:class:`GraniteMultipliers`):

- ``embedding_multiplier`` scales the token embeddings;
- ``residual_multiplier`` scales each attention and MLP output before it is added to the
  residual stream;
- ``attention_multiplier`` is the attention scale (in place of ``head_dim ** -0.5``);
- ``logits_scaling`` divides the logits.

Everything else (layers, merged projections, checkpoint names, tensor-parallel sharding) is
:class:`LlamaForCausalLM`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaAttention, LlamaForCausalLM
from chassis.core import parallel_state
from chassis.core.attention import ForwardContext
from chassis.core.layers.norm import RMSNorm
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.layers.vocab_parallel import VocabParallelEmbedding, gather_logits
from chassis.core.model_interface import ModelBuildContext


@dataclass(frozen=True)
class GraniteMultipliers:
    """Granite's scalars, read from the HF config (each defaults to 1, as in HF)."""

    #: multiplies the token embeddings
    embedding: float
    #: multiplies each attention and MLP output before the residual add
    residual: float
    #: multiplies ``q . k`` (the attention scale)
    attention: float
    #: divides the logits
    logits_scaling: float

    @classmethod
    def from_config(cls, hf_config: Any) -> GraniteMultipliers:
        """The config's multipliers; a ``ValueError`` for a ``logits_scaling`` of 0."""

        def read(field: str) -> float:
            value = getattr(hf_config, field, None)
            return 1.0 if value is None else float(value)

        multipliers = cls(
            embedding=read("embedding_multiplier"),
            residual=read("residual_multiplier"),
            attention=read("attention_multiplier"),
            logits_scaling=read("logits_scaling"),
        )
        if multipliers.logits_scaling == 0:
            raise ValueError("config logits_scaling is 0; the logits are divided by it")
        return multipliers


class GraniteDecoderLayer(nn.Module):
    """Llama's pre-norm layer (residual add fused into the norms) with the attention scale
    and the residual multiplier of :class:`GraniteMultipliers`."""

    def __init__(
        self,
        spec: DecoderSpec,
        multipliers: GraniteMultipliers,
        rotary_emb: RotaryEmbedding,
        layer_idx: int,
        build_ctx: ModelBuildContext,
        mlp: nn.Module,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(
            spec, rotary_emb, layer_idx, build_ctx, scale=multipliers.attention
        )
        #: ``[T, hidden] -> [T, hidden]``, already summed over a tensor-parallel group
        self.mlp = mlp
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.residual_multiplier = multipliers.residual

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(scaled mlp output, residual stream)``; their sum is the layer's output."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, ctx) * self.residual_multiplier
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states) * self.residual_multiplier, residual


class GraniteModel(nn.Module):
    """Scaled embedding, Granite decoder layers and final norm (HF's ``model.*``)."""

    def __init__(
        self,
        hf_config: Any,
        spec: DecoderSpec,
        multipliers: GraniteMultipliers,
        build_ctx: ModelBuildContext,
        make_mlp: Callable[[int], nn.Module],
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(int(hf_config.vocab_size), spec.hidden_size)
        self.embedding_multiplier = multipliers.embedding
        rotary_emb = RotaryEmbedding(
            spec.head_dim, spec.max_position, spec.rope, context_len=build_ctx.max_model_len
        )
        self.layers = nn.ModuleList(
            GraniteDecoderLayer(spec, multipliers, rotary_emb, i, build_ctx, make_mlp(i))
            for i in range(int(hf_config.num_hidden_layers))
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        # in the model dtype, as HF multiplies (the embedding is whole on every rank here)
        hidden_states = self.embed_tokens(input_ids) * self.embedding_multiplier
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, ctx)
        if residual is None:  # a model with no layers
            return self.norm(hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class GraniteForCausalLM(LlamaForCausalLM):
    """``GraniteForCausalLM`` checkpoints (granite-3.0/3.1/3.2/3.3 2b and 8b, base and
    instruct).

    The multipliers are kept as ``self.multipliers``. A ``sliding_window`` in the config is
    ignored, as HF's Granite ignores it.
    """

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec.from_config(hf_config, sliding_window=None)

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> GraniteModel:
        self.multipliers = GraniteMultipliers.from_config(hf_config)
        return GraniteModel(hf_config, self.spec, self.multipliers, build_ctx, self.make_mlp)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """As :meth:`LlamaForCausalLM.compute_logits`, divided by ``logits_scaling`` in the
        model dtype (where HF divides, so 16-bit logits round as HF's do)."""
        logits = self.lm_head(hidden_states) / self.multipliers.logits_scaling
        if parallel_state.tp_size() > 1:
            logits = gather_logits(logits, self.vocab_size)
        return logits.float()
