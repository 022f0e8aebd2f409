"""IBM Granite 4.0-H (``GraniteMoeHybridForCausalLM``): Granite MoE Shared whose layers are
mostly Mamba2 mixers, a few attention.

As HF transformers' ``GraniteMoeHybrid`` code defines it:

- ``layer_types`` (alias ``layers_block_type``) names each layer's mixer: ``"mamba"`` /
  ``"linear_attention"`` (a :class:`~chassis.core.layers.mamba2_mixer.Mamba2Mixer`, the
  config's ``mamba_*`` fields) or ``"attention"`` / ``"full_attention"`` (Granite's
  attention, scaled by ``attention_multiplier``). Only the attention layers have a KV cache;
  the mamba layers carry a state per request.
- ``position_embedding_type`` ``"rope"`` rotates q and k; anything else (``None``, the
  Granite 4.0-H checkpoints') uses no position encoding at all ("NoPE").
- Every layer has the shared MLP (``shared_mlp``) and, with ``num_local_experts > 0``, the
  stacked experts of Granite MoE (``block_sparse_moe``) added to it; Granite's four
  multipliers as in :mod:`~chassis.builtin_plugins.models.granite`.

Checkpoint names and the expert and shared-MLP loading are Granite MoE Shared's; the mixers'
tensors (``mamba.*``) load under their own names.

Tensor parallel: attention, MLPs, experts, embeddings and LM head as Granite MoE's; each
mixer keeps this rank's heads and groups (:mod:`chassis.core.layers.mamba2_shard`:
``mamba_n_heads`` must divide by the ranks, ``mamba_n_groups`` divide them or by them) and
its output is summed over the group.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.granitemoeshared import GraniteMoeSharedForCausalLM
from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaAttention, LlamaMLP, LlamaModel
from chassis.core import parallel_state
from chassis.core.attention import ForwardContext
from chassis.core.layers.mamba2_mixer import (
    Mamba2Mixer,
    Mamba2Spec,
    ShardedMixer,
    check_silu,
    mamba2_checkpoint_part,
    mamba2_mixers,
)
from chassis.core.layers.mamba2_shard import mamba2_shard
from chassis.core.layers.norm import RMSNorm
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.model_interface import ModelBuildContext
from chassis.core.request_state_cache import RequestStateSpec

#: ``layer_types`` values -> the mixer kind
_LAYER_KINDS = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "attention": "attention",
    "full_attention": "attention",
}


def hybrid_layer_kinds(hf_config: Any) -> list[str]:
    """``"mamba"`` or ``"attention"`` per layer, from ``layer_types`` (or
    ``layers_block_type``); a ``ValueError`` for another value or a wrong count."""
    types = getattr(hf_config, "layer_types", None) or getattr(hf_config, "layers_block_type", None)
    num_layers = int(hf_config.num_hidden_layers)
    if not types or len(types) != num_layers:
        raise ValueError(
            f"config layer_types must name each of the {num_layers} layers' mixer, got {types!r}"
        )
    unknown = sorted({t for t in types if t not in _LAYER_KINDS})
    if unknown:
        raise ValueError(
            f"config layer_types {unknown} not supported (known: {', '.join(_LAYER_KINDS)})"
        )
    return [_LAYER_KINDS[t] for t in types]


def granite_mamba_spec(
    hf_config: Any, intermediate_size: int | None = None, **options: Any
) -> Mamba2Spec:
    """The mixer of GraniteMoeHybrid / Bamba configs (``mamba_*`` fields). Falcon-H1 reads the
    same fields and passes its own ``intermediate_size`` (default ``mamba_expand`` x hidden)
    and further :class:`Mamba2Spec` ``options``."""
    check_silu(hf_config)
    hidden = int(hf_config.hidden_size)
    intermediate = intermediate_size
    if intermediate is None:
        intermediate = int(hf_config.mamba_expand) * hidden
    heads = int(hf_config.mamba_n_heads)
    head_dim = hf_config.mamba_d_head
    head_dim = intermediate // heads if head_dim in (None, "auto") else int(head_dim)
    limit = getattr(hf_config, "time_step_limit", None) or (0.0, float("inf"))
    return Mamba2Spec(
        hidden_size=hidden,
        num_heads=heads,
        head_dim=head_dim,
        d_state=int(hf_config.mamba_d_state),
        n_groups=int(hf_config.mamba_n_groups),
        d_conv=int(hf_config.mamba_d_conv),
        intermediate_size=intermediate,
        chunk_size=int(getattr(hf_config, "mamba_chunk_size", 256) or 256),
        conv_bias=bool(hf_config.mamba_conv_bias),
        proj_bias=bool(hf_config.mamba_proj_bias),
        norm_eps=float(hf_config.rms_norm_eps),
        time_step_limit=(float(limit[0]), float(limit[1])),
        **options,
    )


class NoPEAttention(LlamaAttention):
    """Granite's attention without rotary positions (``position_embedding_type`` not
    ``"rope"``)."""

    def encode_positions(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


class SharedMlpBlock(nn.Module):
    """A dense GraniteMoeHybrid layer's MLP (``num_local_experts`` 0): the shared MLP
    alone, named as in the MoE block (``mlp.shared_mlp``)."""

    def __init__(self, spec: DecoderSpec, intermediate_size: int) -> None:
        super().__init__()
        # this rank's columns (all of them without tensor parallelism)
        _, share = parallel_state.shard(intermediate_size, "shared_intermediate_size")
        self.shared_mlp = LlamaMLP(spec, share)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_mlp(x)


class HybridDecoderLayer(nn.Module):
    """Granite's pre-norm layer around a mamba mixer (``mamba``) or attention
    (``self_attn``), the residual multiplier on both blocks' outputs; returns
    ``(scaled mlp output, residual stream)`` as :class:`~chassis.builtin_plugins.models.
    granite.GraniteDecoderLayer`."""

    def __init__(
        self,
        spec: DecoderSpec,
        mixer: nn.Module,
        mlp: nn.Module,
        residual_multiplier: float,
    ) -> None:
        super().__init__()
        self.mamba: Mamba2Mixer | None = mixer if isinstance(mixer, Mamba2Mixer) else None
        self.self_attn: nn.Module | None = None if self.mamba is not None else mixer
        self.mlp = mlp
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.residual_multiplier = residual_multiplier

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if self.mamba is not None:
            hidden_states = self.mamba(hidden_states, ctx)
        else:
            assert self.self_attn is not None
            hidden_states = self.self_attn(positions, hidden_states, ctx)
        hidden_states = hidden_states * self.residual_multiplier
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states) * self.residual_multiplier, residual


class GraniteMoeHybridForCausalLM(GraniteMoeSharedForCausalLM):
    """``GraniteMoeHybridForCausalLM`` checkpoints (ibm-granite/granite-4.0-h-micro,
    -h-tiny, -h-small, base and instruct; dense or MoE).

    Attention layer ``j`` (counting attention layers only) reads KV cache ``j``
    (:attr:`num_attention_layers` of them); mamba layer ``m`` holds request-state tensors
    ``2m`` (conv) and ``2m + 1`` (SSM). Refused when built: a ``hidden_act`` other than
    ``silu``, unknown ``layer_types``, mixer shapes that do not fit (or do not split over
    ``--tensor-parallel-size``), Granite MoE's refusals.
    """

    has_recurrent_state = True

    @classmethod
    def check_tensor_parallel(cls, hf_config: Any, size: int) -> None:
        if "mamba" in hybrid_layer_kinds(hf_config):
            mamba2_shard(granite_mamba_spec(hf_config), size, 0)

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> LlamaModel:
        self.layer_kinds = hybrid_layer_kinds(hf_config)
        self.mamba_spec = granite_mamba_spec(hf_config)
        self.state_dtype = build_ctx.dtype
        self.uses_rope = self.uses_rope_for(hf_config)
        return super().build_decoder(hf_config, build_ctx)

    @classmethod
    def uses_rope_for(cls, hf_config: Any) -> bool:
        """Whether the attention layers rotate q and k: ``position_embedding_type``
        ``"rope"`` (otherwise no position encoding)."""
        return getattr(hf_config, "position_embedding_type", None) == "rope"

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> HybridDecoderLayer:  # type: ignore[override]
        before = self.layer_kinds[:layer_idx]
        mixer: nn.Module
        if self.layer_kinds[layer_idx] == "mamba":
            mixer = Mamba2Mixer(self.mamba_spec, state_index=2 * before.count("mamba"))
        else:
            attention_cls = LlamaAttention if self.uses_rope else NoPEAttention
            mixer = attention_cls(
                self.spec,
                rotary_emb,
                before.count("attention"),  # its KV cache
                build_ctx,
                scale=self.attention_scale(),
            )
        return HybridDecoderLayer(
            self.spec, mixer, self.make_mlp(layer_idx), self.multipliers.residual
        )

    def attention_scale(self) -> float | None:
        """The attention layers' scale: Granite's ``attention_multiplier`` (``None``:
        ``head_dim ** -0.5``)."""
        return self.multipliers.attention

    def make_mlp(self, layer_idx: int) -> nn.Module:
        if int(getattr(self.hf_config, "num_local_experts", 0) or 0) > 0:
            return super().make_mlp(layer_idx)
        return SharedMlpBlock(self.spec, self.shared_intermediate_size(self.hf_config))

    @property
    def num_attention_layers(self) -> int:
        return hybrid_layer_kinds(self.hf_config).count("attention")

    @functools.cached_property
    def _mamba_mixers(self) -> dict[str, ShardedMixer]:
        return mamba2_mixers(self)

    def _tensor_parallel_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """As Llama's, and a mixer's tensors cut by :func:`mamba2_checkpoint_part`."""
        if ".mamba." in name:
            return mamba2_checkpoint_part(self._mamba_mixers, name, tensor)
        return super()._tensor_parallel_slice(name, tensor)

    def request_state_specs(self) -> list[RequestStateSpec]:
        specs: list[RequestStateSpec] = []
        for i, layer in enumerate(self.model.layers):
            if layer.mamba is not None:
                specs.extend(layer.mamba.state_specs(f"layers.{i}.mamba", self.state_dtype))
        return specs
