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

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.llama import (
    DecoderSpec,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)
from chassis.core import parallel_state
from chassis.core.attention import ForwardContext
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.layers.vocab_parallel import gather_logits
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


class GraniteDecoderLayer(LlamaDecoderLayer):
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
        super().__init__(
            spec, rotary_emb, layer_idx, build_ctx, mlp, attention_scale=multipliers.attention
        )
        self.residual_multiplier = multipliers.residual

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(scaled mlp output, residual stream)``; their sum is the layer's output."""
        hidden_states, residual = self.attend(positions, hidden_states, residual, ctx)
        hidden_states = hidden_states * self.residual_multiplier
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states) * self.residual_multiplier, residual


class GraniteForCausalLM(LlamaForCausalLM):
    """``GraniteForCausalLM`` checkpoints (granite-3.0/3.1/3.2/3.3 2b and 8b, base and
    instruct).

    The multipliers are kept as ``self.multipliers``. A ``sliding_window`` in the config is
    ignored, as HF's Granite ignores it.
    """

    #: whether :meth:`compute_logits` divides by ``logits_scaling`` (as ``GraniteForCausalLM``
    #: does); a wrapper whose HF class has its own LM head over the Granite text model
    #: (LLaVA's, :mod:`.llava`) clears it, since that head divides nothing
    applies_logits_scaling: bool = True

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec.from_config(hf_config, sliding_window=None)

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> LlamaModel:
        """Llama's decoder with the scaled embedding and :meth:`make_layer`'s layers."""
        self.multipliers = GraniteMultipliers.from_config(hf_config)
        return LlamaModel(
            hf_config,
            self.spec,
            build_ctx,
            self.make_layer,
            embedding_multiplier=self.multipliers.embedding,
        )

    def prompt_embeds_to_inputs(self, rows: torch.Tensor) -> torch.Tensor:
        """Given rows times the embedding multiplier: HF's Granite forward scales the
        ``inputs_embeds`` it is given as it scales its own (the decoder's ``embed``)."""
        return rows * self.multipliers.embedding

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> GraniteDecoderLayer:
        return GraniteDecoderLayer(
            self.spec,
            self.multipliers,
            rotary_emb,
            layer_idx,
            build_ctx,
            self.make_mlp(layer_idx),
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """As :meth:`LlamaForCausalLM.compute_logits`, divided by ``logits_scaling`` in the
        model dtype (where HF divides, so 16-bit logits round as HF's do) unless
        :attr:`applies_logits_scaling` is cleared."""
        logits = self.lm_head(hidden_states)
        if self.applies_logits_scaling:
            logits = logits / self.multipliers.logits_scaling
        if parallel_state.tp_size() > 1:
            logits = gather_logits(logits, self.vocab_size)
        return logits.float()
