"""OLMo 2: the Llama decoder with its norms after each block and an RMSNorm over the whole q
and k projections.

As HF transformers' ``Olmo2`` code defines it, a layer is::

    h = h + post_attention_layernorm(attn(h))
    h = h + post_feedforward_layernorm(mlp(h))

with no norm before attention or the MLP (the residual stream goes into them as it is), and
inside attention ``q = q_norm(q_proj(h))``, ``k = k_norm(k_proj(h))`` before RoPE: one
RMSNorm over all heads of the projection together (weights of ``num_heads * head_dim`` and
``num_kv_heads * head_dim``), not Qwen3's per-head norm.

The projections, their merged ``qkv_proj``/``gate_up_proj`` weights, the checkpoint names
and the tensor-parallel sharding are :class:`LlamaForCausalLM`'s. Under tensor parallelism a
rank holds only some of the q and k columns; the norm's mean square still covers the whole
projection: each rank sums the squares of its columns and one all-reduce per layer adds them
up (:meth:`Olmo2Attention.normalize_qk`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.llama import (
    DecoderSpec,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaModel,
)
from chassis.core import parallel_state
from chassis.core.attention import ForwardContext
from chassis.core.layers.norm import RMSNorm
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.model_interface import ModelBuildContext

#: the projection norms, each sharded as the projection it normalizes
_PROJECTION_NORMS = {"q_norm": "q_proj", "k_norm": "k_proj"}


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole q or k projection, all heads together (OLMo 2's ``q_norm`` and
    ``k_norm``).

    ``weight`` holds this rank's columns of the projection (all of them without tensor
    parallelism). ``forward(x)`` normalizes by the mean square of ``x``'s own columns;
    ``forward(x, mean_square)`` by a given ``[T, 1]`` float32 mean square (the whole
    projection's, when ``x`` is one rank's share). In float32, with the scale applied before
    the cast back to ``x``'s dtype: HF's ``Olmo2RMSNorm`` order, so 16-bit results round as
    HF's do (Llama's :class:`RMSNorm` casts before scaling).
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, mean_square: torch.Tensor | None = None) -> torch.Tensor:
        x32 = x.float()
        if mean_square is None:
            mean_square = x32.pow(2).mean(-1, keepdim=True)
        return (self.weight * (x32 * torch.rsqrt(mean_square + self.eps))).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class Olmo2Attention(LlamaAttention):
    """:class:`LlamaAttention` with :class:`ProjectionRMSNorm` on q and k before RoPE.

    ``q_norm``/``k_norm`` have this rank's ``q_size``/``kv_size`` columns; ``spec.qk_norm``
    (the per-head norm) must be off. The layer's window is ``spec.attention_window`` (none for
    OLMo 2, whose spec has no ``sliding_window``; OLMo 3's sliding layers have one).
    """

    def __init__(
        self,
        spec: DecoderSpec,
        rotary_emb: RotaryEmbedding,
        layer_idx: int,
        build_ctx: ModelBuildContext,
    ) -> None:
        window = spec.attention_window(layer_idx, build_ctx.max_model_len)
        super().__init__(spec, rotary_emb, layer_idx, build_ctx, sliding_window=window)
        self.q_norm = ProjectionRMSNorm(self.q_size, spec.rms_norm_eps)
        self.k_norm = ProjectionRMSNorm(self.kv_size, spec.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q_norm(q)`` and ``k_norm(k)`` over the whole projections; ``q [T, q_size]`` and
        ``k [T, kv_size]`` are this rank's columns."""
        size = parallel_state.tp_size()
        if size == 1:
            return self.q_norm(q), self.k_norm(k)
        # [T, 2]: the sums of squares of this rank's q and k columns, then of every rank's.
        sums = torch.stack((q.float().pow(2).sum(-1), k.float().pow(2).sum(-1)), dim=-1)
        sums = parallel_state.all_reduce(sums)
        # Every rank holds the same number of columns, so the group's sum over
        # size * (columns per rank) is the whole projection's mean square. That also holds
        # for k with fewer KV heads than ranks: each rank then holds one head, replicated
        # size / num_kv_heads times, and the sum counts each head as many times as the
        # divisor does.
        q_mean_square = sums[:, 0:1] / (size * q.shape[-1])
        k_mean_square = sums[:, 1:2] / (size * k.shape[-1])
        return self.q_norm(q, q_mean_square), self.k_norm(k, k_mean_square)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj(hidden_states).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1
        )
        q, k = self.normalize_qk(q, k)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        # Each rank holds some heads: o_proj's partial sums add up to the whole output.
        return parallel_state.all_reduce(self.o_proj(self.attn(q, k, v, ctx)))


class Olmo2DecoderLayer(nn.Module):
    """Attention and MLP blocks, each output normalized before it is added to the residual
    stream (no norm on their inputs). ``self_attn`` replaces the default
    :class:`Olmo2Attention` (EXAONE 4.0's per-head q/k norms)."""

    def __init__(
        self,
        spec: DecoderSpec,
        rotary_emb: RotaryEmbedding,
        layer_idx: int,
        build_ctx: ModelBuildContext,
        mlp: nn.Module,
        *,
        self_attn: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if self_attn is None:
            self_attn = Olmo2Attention(spec, rotary_emb, layer_idx, build_ctx)
        #: ``(positions, [T, hidden], ctx) -> [T, hidden]``, summed over a tensor-parallel group
        self.self_attn = self_attn
        #: ``[T, hidden] -> [T, hidden]``, already summed over a tensor-parallel group
        self.mlp = mlp
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """``[T, hidden]`` residual stream in, the next one out."""
        attn_out = self.self_attn(positions, hidden_states, ctx)
        hidden_states = hidden_states + self.post_attention_layernorm(attn_out)
        return hidden_states + self.post_feedforward_layernorm(self.mlp(hidden_states))


class Olmo2Model(LlamaModel):
    """:class:`LlamaModel` of :class:`Olmo2DecoderLayer` s, which pass the residual stream
    itself from layer to layer (no residual add for the final norm to fuse)."""

    keeps_aux_hidden_states = False  # its own forward keeps none: EAGLE-3 is refused

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states; ``inputs_embeds`` (:meth:`embed`'s output, some rows
        replaced: prompt embeddings) stands in for ``embed(input_ids)`` when given."""
        hidden_states = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, ctx)
        return self.norm(hidden_states)


class Olmo2ForCausalLM(LlamaForCausalLM):
    """``Olmo2ForCausalLM`` checkpoints (OLMo-2-1124-7B/13B, OLMo-2-0325-32B,
    OLMo-2-0425-1B and their instruct versions).

    Weight loading and tensor parallelism are :class:`LlamaForCausalLM`'s; ``q_norm`` and
    ``k_norm`` weights are split as the projections they normalize (q columns by head, k
    columns by KV head, replicated when there are fewer KV heads than ranks). The other
    norms are whole on every rank. ``attention_bias`` is honoured (OLMo 2 checkpoints have
    none); a ``sliding_window`` in the config is ignored, as HF's Olmo2 ignores it.
    """

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec.from_config(hf_config, sliding_window=None)

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> Olmo2Model:
        return Olmo2Model(hf_config, self.spec, build_ctx, self.make_layer)

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> Olmo2DecoderLayer:
        return Olmo2DecoderLayer(
            self.spec, rotary_emb, layer_idx, build_ctx, self.make_mlp(layer_idx)
        )

    def _tensor_parallel_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """As :class:`LlamaForCausalLM`'s, and a ``q_norm``/``k_norm`` weight split as the
        rows of ``q_proj``/``k_proj``."""
        parts = name.split(".")
        projection = _PROJECTION_NORMS.get(parts[-2]) if len(parts) > 1 else None
        if projection is not None:
            name = ".".join([*parts[:-2], projection, parts[-1]])
        return super()._tensor_parallel_slice(name, tensor)
