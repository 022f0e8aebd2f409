"""MiniMax-M2 / M2.1 / M2.5 (``MiniMaxM2ForCausalLM``): Llama's pre-norm decoder with OLMo 2's
q/k norms over the whole projections, partial RoPE and a mixture of experts in every layer,
routed by DeepSeek-V3's sigmoid scores with ``e_score_correction_bias``.

As HF transformers' ``MiniMaxM2`` code defines it, what differs from Llama:

- **Attention**: no biases; ``q = q_norm(q_proj(h))`` and ``k = k_norm(k_proj(h))`` before
  RoPE, each one RMSNorm over the whole projection (weights of ``num_heads * head_dim`` and
  ``num_kv_heads * head_dim``, as OLMo 2's, :class:`~.olmo2.Olmo2Attention`), scaling after
  the cast back to the input dtype (Llama's norm order, not OLMo 2's); RoPE over the first
  ``rotary_dim`` dimensions of each head (the config turns ``rotary_dim`` into
  ``partial_rotary_factor = rotary_dim / head_dim``), in Llama's rotate-half layout.
- **MLP**: every layer a mixture of ``num_local_experts`` SwiGLU experts of
  ``intermediate_size`` (checkpoint ``block_sparse_moe.experts.<e>.w1/w3/w2``, Mixtral's
  names), no shared expert, no dense layer. The router ``block_sparse_moe.gate`` scores
  ``sigmoid(x @ gate.weight^T)`` (float32 here); the block's ``e_score_correction_bias`` is
  added only to choose the ``num_experts_per_tok`` experts; their *unbiased* scores, divided
  by their sum, weight the experts. That is DeepSeek-V3's ``noaux_tc`` router
  (:class:`~.deepseek_v3.DeepseekV3Router`) with one group, ``norm_topk_prob`` always on and
  no ``routed_scaling_factor``, which it is built as.
- The checkpoints' multi-token-prediction layers past ``num_hidden_layers`` are not read (HF
  does not load them either).

Refused when the model is built (fields HF's config keeps but its code does not read, whose
other values would need something HF does not compute): ``scoring_func`` other than
``sigmoid``, ``use_qk_norm`` false, ``qk_norm_type`` other than ``per_layer``, ``use_routing_bias``
false, a ``shared_intermediate_size`` above 0, an ``attn_type_list`` with other than full
attention (1), a ``routed_scaling_factor`` other than 1; and, as everywhere, a ``hidden_act``
other than ``silu``.

Tensor parallel: Llama's and the MoE models' (heads and KV heads split, every expert's
intermediate columns split, or whole experts per rank with ``--enable-expert-parallel``;
the router whole). ``q_norm``/``k_norm`` weights are split as the projections they normalize
and their mean square covers the whole projection: one all-reduce of the per-rank sums of
squares per layer (:meth:`~.olmo2.Olmo2Attention.normalize_qk`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.deepseek_v2 import DeepseekMoeForCausalLM, RouterSpec
from chassis.builtin_plugins.models.deepseek_v3 import DeepseekV3Router
from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaDecoderLayer
from chassis.builtin_plugins.models.olmo2 import Olmo2Attention, ProjectionRMSNorm
from chassis.builtin_plugins.models.sparse_moe import MoeSpec
from chassis.core.layers.rotary import RotaryEmbedding, rope_parameters
from chassis.core.model_interface import ModelBuildContext

#: the projection norms, each sharded as the projection it normalizes
_PROJECTION_NORMS = {"q_norm": "q_proj", "k_norm": "k_proj"}
#: ``attn_type_list`` value of a full (softmax) attention layer; 0 is MiniMax-01's linear one
_FULL_ATTENTION = 1


def _int_field(hf_config: Any, field: str) -> int:
    value = getattr(hf_config, field, None)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config {field} must be a positive integer; got {value!r}")
    return value


class MiniMaxM2ProjectionRMSNorm(ProjectionRMSNorm):
    """:class:`ProjectionRMSNorm` in HF's ``MiniMaxM2RMSNorm`` order: normalized in float32,
    cast back to the input dtype, then scaled (so 16-bit results round as HF's do)."""

    def forward(self, x: torch.Tensor, mean_square: torch.Tensor | None = None) -> torch.Tensor:
        x32 = x.float()
        if mean_square is None:
            mean_square = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(mean_square + self.eps)).to(x.dtype)


class MiniMaxM2Attention(Olmo2Attention):
    """:class:`Olmo2Attention` (whole-projection q/k norms, partial RoPE from the shared
    table) with MiniMax-M2's norm order."""

    def __init__(
        self,
        spec: DecoderSpec,
        rotary_emb: RotaryEmbedding,
        layer_idx: int,
        build_ctx: ModelBuildContext,
    ) -> None:
        super().__init__(spec, rotary_emb, layer_idx, build_ctx)
        self.q_norm = MiniMaxM2ProjectionRMSNorm(self.q_size, spec.rms_norm_eps)
        self.k_norm = MiniMaxM2ProjectionRMSNorm(self.kv_size, spec.rms_norm_eps)


class MiniMaxM2ForCausalLM(DeepseekMoeForCausalLM):
    """``MiniMaxM2ForCausalLM`` checkpoints (MiniMax-M2, M2.1, M2.5; the module docstring)."""

    #: Mixtral's block name, and the correction bias moved from the block to its router
    checkpoint_renames = (
        (".block_sparse_moe.", ".mlp."),
        (".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
    )
    topk_methods = ("noaux_tc",)
    scoring_func = "sigmoid"

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        """Refuse the config values HF's code would not compute (the module docstring)."""
        checks = (
            ("use_qk_norm", True),
            ("qk_norm_type", "per_layer"),
            ("use_routing_bias", True),
        )
        for field, supported in checks:
            value = getattr(hf_config, field, None)
            if value is not None and value != supported:
                raise ValueError(
                    f"config {field} {value!r} is not supported by MiniMaxM2ForCausalLM "
                    f"(only {supported!r}, what HF transformers' MiniMaxM2 computes)"
                )
        shared = getattr(hf_config, "shared_intermediate_size", None)
        if shared:
            raise ValueError(
                f"config shared_intermediate_size {shared!r} is not supported: MiniMax-M2 "
                "has no shared expert (only 0)"
            )
        attn_types = getattr(hf_config, "attn_type_list", None)
        if attn_types and any(int(t) != _FULL_ATTENTION for t in attn_types):
            raise ValueError(
                "config attn_type_list names linear-attention layers (0), which are not "
                "supported: MiniMaxM2ForCausalLM has full attention (1) in every layer"
            )
        scaling = getattr(hf_config, "routed_scaling_factor", None)
        if scaling is not None and float(scaling) != 1.0:
            raise ValueError(
                f"config routed_scaling_factor {scaling!r} is not supported: MiniMax-M2's "
                "router applies none (only 1.0)"
            )

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        cls.check_config(hf_config)
        rope = rope_parameters(hf_config)
        rotary_dim = getattr(hf_config, "rotary_dim", None)
        if rope.get("partial_rotary_factor") is None and rotary_dim is not None:
            # a config that kept only the checkpoints' rotary_dim (HF derives the factor)
            head_dim = getattr(hf_config, "head_dim", None) or (
                hf_config.hidden_size // hf_config.num_attention_heads
            )
            rope["partial_rotary_factor"] = int(rotary_dim) / int(head_dim)
        return DecoderSpec.from_config(
            hf_config,
            qkv_bias=False,
            o_bias=False,
            mlp_bias=False,
            qk_norm=False,
            sliding_window=None,
            rope=rope,
        )

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoeSpec:
        return MoeSpec(
            num_experts=_int_field(hf_config, "num_local_experts"),
            top_k=_int_field(hf_config, "num_experts_per_tok"),
            intermediate_size=_int_field(hf_config, "intermediate_size"),
            renormalize=False,  # the router normalizes
            round_weights_to_model_dtype=False,  # HF scales the experts' outputs in float32
            intermediate_size_field="intermediate_size",
        )

    @classmethod
    def router_spec(cls, hf_config: Any) -> RouterSpec:
        scoring = getattr(hf_config, "scoring_func", None)
        if scoring is not None and scoring != cls.scoring_func:
            raise ValueError(
                f"config scoring_func {scoring!r} is not supported by {cls.__name__} "
                f"(only {cls.scoring_func!r})"
            )
        num_experts = _int_field(hf_config, "num_local_experts")
        top_k = _int_field(hf_config, "num_experts_per_tok")
        if top_k > num_experts:
            raise ValueError(
                f"config num_experts_per_tok {top_k} exceeds num_local_experts {num_experts}"
            )
        return RouterSpec(
            num_experts=num_experts,
            top_k=top_k,
            topk_method="noaux_tc",
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=1.0,
        )

    def make_router(self) -> nn.Module:
        return DeepseekV3Router(self.router, self.spec.hidden_size)

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> nn.Module:
        attention = MiniMaxM2Attention(self.spec, rotary_emb, layer_idx, build_ctx)
        return LlamaDecoderLayer(
            self.spec,
            rotary_emb,
            layer_idx,
            build_ctx,
            self.make_mlp(layer_idx),
            norm_class=self.norm_class,
            self_attn=attention,
        )

    def _tensor_parallel_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """As :class:`LlamaForCausalLM`'s, and a ``q_norm``/``k_norm`` weight split as the
        rows of ``q_proj``/``k_proj`` (OLMo 2's)."""
        parts = name.split(".")
        projection = _PROJECTION_NORMS.get(parts[-2]) if len(parts) > 1 else None
        if projection is not None:
            name = ".".join([*parts[:-2], projection, parts[-1]])
        return super()._tensor_parallel_slice(name, tensor)
