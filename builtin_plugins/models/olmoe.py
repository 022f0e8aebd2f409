"""OLMoE: the Llama decoder with OLMo's q/k norms over the whole projections, an optional
clamp of q, k and v, and a softmax top-k mixture of experts in every layer.

As HF transformers' ``Olmoe`` code defines it, what differs from Llama:

- Inside attention, ``q = q_norm(q_proj(h))`` and ``k = k_norm(k_proj(h))`` before RoPE: one
  RMSNorm over all heads of the projection together (weights of ``num_heads * head_dim`` and
  ``num_kv_heads * head_dim``), as OLMo 2's (:class:`~chassis.builtin_plugins.models.olmo2.
  ProjectionRMSNorm`), but rounding as Llama's RMSNorm does (cast to the model dtype, then
  scale).
- ``clip_qkv``: when set, the normalized q and k and the raw v are clamped to
  ``[-clip_qkv, clip_qkv]`` before RoPE.
- Layers stay pre-norm (``input_layernorm``, ``post_attention_layernorm``), unlike OLMo 2.
- Every layer's MLP is a mixture of ``num_experts`` SwiGLU experts (``mlp.gate`` router,
  ``mlp.experts.<e>.{gate,up,down}_proj``): a float32 softmax over the router logits, the
  ``num_experts_per_tok`` largest, divided by their sum when ``norm_topk_prob``, rounded to
  the model dtype (:class:`~chassis.builtin_plugins.models.sparse_moe.SparseMoeBlock`).

Tensor parallelism is :class:`~chassis.builtin_plugins.models.sparse_moe.
SparseMoeForCausalLM`'s (experts split by intermediate columns, or whole experts per rank
with expert parallelism); the q/k norms take their mean square over the whole projection
with one all-reduce per layer, as OLMo 2's
(:meth:`~chassis.builtin_plugins.models.olmo2.Olmo2Attention.normalize_qk`).
"""

from __future__ import annotations

from typing import Any

import torch

from chassis.builtin_plugins.models.llama import (
    DecoderSpec,
    LlamaDecoderLayer,
    head_dim_of,
)
from chassis.builtin_plugins.models.olmo2 import Olmo2Attention, ProjectionRMSNorm
from chassis.builtin_plugins.models.sparse_moe import MoeSpec, SparseMoeForCausalLM
from chassis.core import parallel_state
from chassis.core.attention import ForwardContext
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.model_interface import ModelBuildContext

#: the projection norms, each sharded as the projection it normalizes
_PROJECTION_NORMS = {"q_norm": "q_proj", "k_norm": "k_proj"}


class OlmoeProjectionRMSNorm(ProjectionRMSNorm):
    """:class:`ProjectionRMSNorm` that casts the normalized values to ``x``'s dtype before
    the scale, as HF's ``OlmoeRMSNorm`` does (OLMo 2's scales first); the same in float32."""

    def forward(self, x: torch.Tensor, mean_square: torch.Tensor | None = None) -> torch.Tensor:
        x32 = x.float()
        if mean_square is None:
            mean_square = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(mean_square + self.eps)).to(x.dtype)


class OlmoeAttention(Olmo2Attention):
    """:class:`Olmo2Attention` with :class:`OlmoeProjectionRMSNorm` s and ``clip_qkv`` (a
    clamp of the normed q and k and of v; ``None``: none)."""

    def __init__(
        self,
        spec: DecoderSpec,
        rotary_emb: RotaryEmbedding,
        layer_idx: int,
        build_ctx: ModelBuildContext,
        clip_qkv: float | None,
    ) -> None:
        super().__init__(spec, rotary_emb, layer_idx, build_ctx)
        self.q_norm = OlmoeProjectionRMSNorm(self.q_size, spec.rms_norm_eps)
        self.k_norm = OlmoeProjectionRMSNorm(self.kv_size, spec.rms_norm_eps)
        self.clip_qkv = clip_qkv

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj(hidden_states).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1
        )
        q, k = self.normalize_qk(q, k)
        if self.clip_qkv is not None:
            clip = self.clip_qkv
            q, k, v = q.clamp(-clip, clip), k.clamp(-clip, clip), v.clamp(-clip, clip)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        # Each rank holds some heads: o_proj's partial sums add up to the whole output.
        return parallel_state.all_reduce(self.o_proj(self.attn(q, k, v, ctx)))


class OlmoeForCausalLM(SparseMoeForCausalLM):
    """``OlmoeForCausalLM`` checkpoints (allenai OLMoE-1B-7B-0924 / -0125, base and
    Instruct).

    Llama's pre-norm :class:`~chassis.builtin_plugins.models.llama.LlamaDecoderLayer` s
    around :class:`OlmoeAttention` and a sparse MoE block in every layer. ``attention_bias``
    is honoured (q, k, v and o; OLMoE checkpoints have none); a ``sliding_window`` in the
    config is ignored, as HF's default attention ignores it. Refused when the model is
    built: another ``hidden_act`` than ``silu``, a RoPE type the rotary layer does not
    implement, and a ``head_dim`` other than ``hidden_size / num_attention_heads`` (HF's
    q/k norms are sized by the latter).
    """

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        head_dim = head_dim_of(hf_config)
        heads = int(hf_config.num_attention_heads)
        if head_dim * heads != int(hf_config.hidden_size):
            raise ValueError(
                f"config head_dim {head_dim} is not supported for OLMoE: its q/k norms are "
                f"sized by hidden_size / num_attention_heads ({hf_config.hidden_size} / "
                f"{heads})"
            )
        return DecoderSpec.from_config(hf_config, sliding_window=None, mlp_bias=False)

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoeSpec:
        return MoeSpec(
            num_experts=int(hf_config.num_experts),
            top_k=int(hf_config.num_experts_per_tok),
            intermediate_size=int(hf_config.intermediate_size),
            renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
            round_weights_to_model_dtype=True,
            intermediate_size_field="intermediate_size",
        )

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> LlamaDecoderLayer:
        clip = getattr(self.hf_config, "clip_qkv", None)
        self_attn = OlmoeAttention(
            self.spec,
            rotary_emb,
            layer_idx,
            build_ctx,
            clip_qkv=None if clip is None else float(clip),
        )
        return LlamaDecoderLayer(
            self.spec,
            rotary_emb,
            layer_idx,
            build_ctx,
            self.make_mlp(layer_idx),
            self_attn=self_attn,
        )

    def _tensor_parallel_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """As :class:`~chassis.builtin_plugins.models.llama.LlamaForCausalLM`'s, and a
        ``q_norm``/``k_norm`` weight split as the rows of ``q_proj``/``k_proj``."""
        parts = name.split(".")
        projection = _PROJECTION_NORMS.get(parts[-2]) if len(parts) > 1 else None
        if projection is not None:
            name = ".".join([*parts[:-2], projection, parts[-1]])
        return super()._tensor_parallel_slice(name, tensor)
