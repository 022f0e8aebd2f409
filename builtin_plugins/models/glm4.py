"""GLM-4 (GLM-4-0414, GLM-Z1): the Llama decoder with two more norms per layer, a fused
gate/up projection in the checkpoint and interleaved partial RoPE.

As HF transformers' ``Glm4`` code defines it, a layer is::

    h = h + post_self_attn_layernorm(attn(input_layernorm(h)))
    h = h + post_mlp_layernorm(mlp(post_attention_layernorm(h)))

i.e. Llama's pre-norm layer whose attention and MLP outputs are normalized once more before
the residual add. The other differences from Llama:

- the checkpoint stores ``mlp.gate_up_proj`` (gate rows, then up) already fused, while q, k
  and v are separate. :meth:`Glm4ForCausalLM.load_weights` cuts the fused tensor into
  ``gate_proj``/``up_proj`` (:func:`~chassis.builtin_plugins.models.phi3.split_fused`), so
  the Llama loader shards each half over a tensor-parallel group as it shards separate
  tensors;
- ``attention_bias`` (default true) puts biases on q, k and v only: ``o_proj`` and the MLP
  never have one;
- RoPE rotates only the first ``head_dim * partial_rotary_factor`` dimensions (the config
  defaults the factor to 0.5) in the interleaved layout: dimension ``2i`` pairs with
  ``2i + 1`` (:mod:`chassis.core.layers.rotary`, ``"interleaved"``), not Llama's halves;
- no sliding window: HF's Glm4 has none, so a ``sliding_window`` in the config is ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.llama import (
    DecoderSpec,
    LlamaDecoderLayer,
    LlamaForCausalLM,
)
from chassis.builtin_plugins.models.phi3 import split_fused
from chassis.core import parallel_state
from chassis.core.attention import ForwardContext
from chassis.core.layers.norm import RMSNorm
from chassis.core.layers.rotary import RotaryEmbedding, rope_parameters
from chassis.core.model_interface import LoRASlice, ModelBuildContext


class Glm4DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer (residual adds fused into the next norm) with
    ``post_self_attn_layernorm`` on the attention output and ``post_mlp_layernorm`` on the
    MLP output."""

    def __init__(
        self,
        spec: DecoderSpec,
        rotary_emb: RotaryEmbedding,
        layer_idx: int,
        build_ctx: ModelBuildContext,
        mlp: nn.Module,
    ) -> None:
        super().__init__(spec, rotary_emb, layer_idx, build_ctx, mlp)
        self.post_self_attn_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(normed mlp output, residual stream)``; their sum is the layer's output."""
        hidden_states, residual = self.attend(positions, hidden_states, residual, ctx)
        hidden_states = self.post_self_attn_layernorm(hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.post_mlp_layernorm(self.mlp(hidden_states)), residual


class Glm4ForCausalLM(LlamaForCausalLM):
    """``Glm4ForCausalLM`` checkpoints (GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1-9B/32B and
    their base and rumination versions).

    Tensor parallelism is Llama's: each rank holds its heads, its rows of the gate and of the
    up half of the fused ``gate_up_proj`` and its vocabulary rows; the four norms of a layer
    are whole on every rank. LoRA adapters name the checkpoint's fused ``gate_up_proj`` and
    adapt it whole; that is refused with ``--tensor-parallel-size`` > 1 (its B would have to
    be cut per half, which is not implemented).
    """

    #: q/k/v are separate in the checkpoint (merged here); gate/up are fused in both
    lora_merged_projections: dict[str, tuple[str, ...]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    }

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        """Q/K/V biases by ``attention_bias`` (never on ``o_proj`` or the MLP: a
        ``mlp_bias`` in the config is ignored, as HF's Glm4 ignores it), no window, and HF's
        RoPE parameters with the interleaved layout."""
        rope = {**rope_parameters(hf_config), "interleaved": True}
        return DecoderSpec.from_config(
            hf_config,
            qkv_bias=bool(getattr(hf_config, "attention_bias", True)),
            o_bias=False,
            mlp_bias=False,
            sliding_window=None,
            rope=rope,
        )

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> Glm4DecoderLayer:
        return Glm4DecoderLayer(
            self.spec, rotary_emb, layer_idx, build_ctx, self.make_mlp(layer_idx)
        )

    def lora_slices(self, module_name: str, module: nn.Module) -> list[LoRASlice]:
        """As Llama's (``gate_up_proj`` one whole slice, as the checkpoint names it), refused
        for ``gate_up_proj`` under tensor parallelism."""
        slices = super().lora_slices(module_name, module)
        if slices and module_name.endswith("gate_up_proj") and parallel_state.tp_size() > 1:
            raise ValueError(
                "LoRA adapters on GLM-4's gate_up_proj are not supported with "
                "--tensor-parallel-size > 1 (the checkpoint fuses gate and up)"
            )
        return slices

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As :meth:`LlamaForCausalLM.load_weights`, with each fused ``gate_up_proj`` tensor
        first split into ``gate_proj`` and ``up_proj``."""

        def unfused() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                yield from split_fused(name, tensor, self.full_spec)

        return super().load_weights(unfused())
