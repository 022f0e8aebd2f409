"""Qwen3-Next (``Qwen3NextForCausalLM``): Gated DeltaNet linear attention in most layers,
gated full attention in the others, a sparse MoE with a shared expert.

As HF transformers' ``qwen3_next`` code defines it:

- ``layer_types`` names each layer's mixer: ``"linear_attention"`` (a
  :class:`~chassis.core.layers.gated_deltanet.GatedDeltaNet`, ``linear_attn.*``; carries a
  state per request, no KV cache) or ``"full_attention"`` (``self_attn.*``; transformers
  fills ``layer_types`` in from ``full_attention_interval``).
- Full attention: ``q_proj`` gives each head's query and an output gate side by side; the
  attention output is multiplied by ``sigmoid(gate)`` before ``o_proj``. Per-head q/k norms,
  RoPE on the first ``partial_rotary_factor`` of each head.
- Every norm but the DeltaNet's gated one is zero-centred: ``(1 + weight)``
  (:class:`~chassis.core.layers.norm.GemmaRMSNorm`).
- MLPs: Qwen2-MoE's sparse block (softmax top-k router, ``norm_topk_prob``, a shared expert
  scaled by ``sigmoid(shared_expert_gate(x))``), or a dense SwiGLU MLP in
  ``mlp_only_layers`` and off the ``decoder_sparse_step``.

Tensor parallelism: each Gated DeltaNet layer keeps whole groups of key and value heads
(:mod:`chassis.core.layers.gated_deltanet_shard`; ``linear_num_key_heads`` must divide by
the ranks), the gated attention its query heads (each head's query and gate rows together)
and KV heads as Llama's, the MoE blocks their experts' and shared expert's columns; the
mixers', attention's and MLPs' outputs are summed over the group.

The checkpoint's multi-token-prediction head (``mtp.*``) is not read. Prefix caching is off
and speculative decoding refused, as for every model with a recurrent state.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.hybrid_layer import HybridDecoderLayer, hybrid_state_specs
from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaAttention, LlamaModel
from chassis.builtin_plugins.models.sparse_moe import MoeSpec, SparseMoeForCausalLM, qwen_moe_spec
from chassis.core import parallel_state
from chassis.core.attention import ForwardContext
from chassis.core.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetSpec
from chassis.core.layers.gated_deltanet_shard import gated_deltanet_shard
from chassis.core.layers.mamba2_mixer import (
    ShardedMixer,
    mamba2_checkpoint_part,
    mamba2_mixers,
)
from chassis.core.layers.norm import GemmaRMSNorm, RMSNorm
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.model_interface import ModelBuildContext
from chassis.core.request_state_cache import RequestStateSpec

#: ``layer_types`` values this model knows
_LAYER_TYPES = ("linear_attention", "full_attention")
#: checkpoint tensors of the multi-token-prediction head, which is not built
_MTP_PREFIX = "mtp."


@dataclass(frozen=True)
class GatedAttentionSpec(DecoderSpec):
    """Qwen3-Next's decoder spec: its ``q_proj`` holds twice the query rows (each head's
    query, then its output gate), so the merged ``qkv_proj`` has ``2 * q + 2 * kv`` rows."""

    def shard_rows(self, merged_rows: int) -> dict[str, tuple[int, int]]:
        rows = super().shard_rows(merged_rows)
        q_size = 2 * self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        rows.update(q=(0, q_size), k=(q_size, kv_size), v=(q_size + kv_size, kv_size))
        return rows


def layer_types_of(hf_config: Any) -> list[str]:
    """``"linear_attention"`` or ``"full_attention"`` per layer; a ``ValueError`` for
    another value or a wrong count."""
    types = list(getattr(hf_config, "layer_types", None) or ())
    num_layers = int(hf_config.num_hidden_layers)
    if len(types) != num_layers:
        raise ValueError(
            f"config layer_types must name each of the {num_layers} layers' mixer, got {types!r}"
        )
    unknown = sorted({t for t in types if t not in _LAYER_TYPES})
    if unknown:
        raise ValueError(f"config layer_types {unknown} not supported (known: {_LAYER_TYPES})")
    return types


class GatedAttention(LlamaAttention):
    """Qwen3-Next's full attention: :class:`LlamaAttention` with zero-centred q/k norms and
    an output gate (``q_proj``'s second half per head), ``o_proj(attn * sigmoid(gate))``."""

    def __init__(
        self,
        spec: DecoderSpec,
        rotary_emb: RotaryEmbedding,
        layer_idx: int,
        build_ctx: ModelBuildContext,
    ) -> None:
        super().__init__(spec, rotary_emb, layer_idx, build_ctx)
        # twice the query rows (query and gate per head: a rank's heads are one run of rows
        # of q_proj); zero-centred norms (replacing the base class's, which are sized for the
        # plain layer)
        self.qkv_proj = nn.Linear(
            spec.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=spec.qkv_bias
        )
        self.q_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q_gate, k, v = self.qkv_proj(hidden_states).split(
            [2 * self.q_size, self.kv_size, self.kv_size], dim=-1
        )
        q_gate = q_gate.view(num_tokens, self.num_heads, 2 * self.head_dim)
        q = q_gate[..., : self.head_dim].contiguous()
        gate = q_gate[..., self.head_dim :].reshape(num_tokens, self.q_size)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.encode_positions(positions, q, k)
        out = self.attn(q, k, v, ctx) * torch.sigmoid(gate)
        # (under tensor parallelism: this rank's heads' share, summed over the group)
        return parallel_state.all_reduce(self.o_proj(out))


class Qwen3NextDecoderLayer(HybridDecoderLayer):
    """A Qwen3-Next layer: Gated DeltaNet (``linear_attn``) or gated attention
    (``self_attn``), zero-centred norms (``(1 + weight)``)."""

    state_mixer_name = "linear_attn"
    linear_attn: GatedDeltaNet | None
    state_mixer_cls = GatedDeltaNet
    norm_cls = GemmaRMSNorm


class Qwen3NextForCausalLM(SparseMoeForCausalLM):
    """``Qwen3NextForCausalLM`` checkpoints (Qwen3-Next-80B-A3B, Instruct and Thinking).

    Full-attention layer ``j`` (counting those only) reads KV cache ``j``; linear-attention
    layer ``m`` holds request-state tensors ``2m`` (conv window) and ``2m + 1`` (delta-rule
    state). Refused when built: a ``hidden_act`` other than ``silu``, unknown
    ``layer_types``, value heads that are not a multiple of the key heads; and before any
    rank starts, key heads that do not divide by ``--tensor-parallel-size``.
    """

    supports_tensor_parallel = True
    has_recurrent_state = True
    norm_class: type[RMSNorm] = GemmaRMSNorm

    @classmethod
    def check_tensor_parallel(cls, hf_config: Any, size: int) -> None:
        if "linear_attention" in layer_types_of(hf_config):
            gated_deltanet_shard(GatedDeltaNetSpec.from_config(hf_config), size, 0)

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        return GatedAttentionSpec.from_config(hf_config, qk_norm=True)

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoeSpec:
        return qwen_moe_spec(hf_config, shared_expert=True)

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> LlamaModel:
        self.layer_types = layer_types_of(hf_config)
        self.deltanet_spec = GatedDeltaNetSpec.from_config(hf_config)
        self.state_dtype = build_ctx.dtype
        return super().build_decoder(hf_config, build_ctx)  # type: ignore[return-value]

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> Qwen3NextDecoderLayer:  # type: ignore[override]
        before = self.layer_types[:layer_idx]
        mixer: nn.Module
        if self.layer_types[layer_idx] == "linear_attention":
            mixer = GatedDeltaNet(
                self.deltanet_spec, state_index=2 * before.count("linear_attention")
            )
        else:
            mixer = GatedAttention(self.spec, rotary_emb, before.count("full_attention"), build_ctx)
        return Qwen3NextDecoderLayer(self.spec, mixer, self.make_mlp(layer_idx))

    @property
    def num_attention_layers(self) -> int:
        return layer_types_of(self.hf_config).count("full_attention")

    def request_state_specs(self) -> list[RequestStateSpec]:
        return hybrid_state_specs(self.model.layers, self.state_dtype)

    @functools.cached_property
    def _deltanet_mixers(self) -> dict[str, ShardedMixer]:
        return mamba2_mixers(self)

    def _tensor_parallel_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """As Llama's, and a Gated DeltaNet layer's tensors cut by its ``checkpoint_part``."""
        if ".linear_attn." in name:
            return mamba2_checkpoint_part(self._deltanet_mixers, name, tensor)
        return super()._tensor_parallel_slice(name, tensor)

    def needs_checkpoint_tensor(self, name: str) -> bool:
        """Not the multi-token-prediction head (``mtp.*``), which is not built."""
        return not name.startswith(_MTP_PREFIX) and super().needs_checkpoint_tensor(name)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As :meth:`SparseMoeForCausalLM.load_weights`, passing over ``mtp.*`` tensors."""
        return super().load_weights((n, t) for n, t in weights if not n.startswith(_MTP_PREFIX))
