"""Llama 4 (Scout, Maverick): the language model, with chunked local attention and MoE.

As HF transformers' ``Llama4TextModel`` defines it, the decoder is Llama's (pre-norm RMSNorm,
grouped-query attention, SwiGLU) except:

- ``no_rope_layers[i]`` says whether layer ``i`` rotates q and k (``1``: RoPE, ``0``: a NoPE
  layer; default a NoPE layer every ``no_rope_layer_interval``, 4). RoPE is the interleaved
  (complex) layout, pairs ``2i, 2i + 1``, with ``rope_scaling`` (``llama3`` in the releases);
- RoPE layers with ``use_qk_norm`` normalize each head of q and k after the rotation (an
  RMS norm without a weight, ``rms_norm_eps``);
- RoPE layers attend locally in chunks (``layer_types`` ``chunked_attention``; by default the
  RoPE layers when ``attention_chunk_size`` is set): the query at position ``p`` sees
  positions ``floor(p / C) * C .. p``. A per-layer option of the attention backends
  (``attention_chunk_size``); a chunk at least ``--max-model-len`` is full attention;
- NoPE layers with ``attn_temperature_tuning`` scale the queries by position:
  ``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))``;
- the MLP of the layers in ``moe_layers`` (default every ``interleave_moe_layer_step``-th) is
  a mixture of experts: a router picks the top ``num_experts_per_tok`` experts by logit, each
  weighted by the sigmoid of its logit, and that weight scales the expert's *input*
  (:func:`~chassis.core.layers.moe.experts_on_weighted_input`); an always-on shared expert
  (``intermediate_size``) is added. The experts come stacked in the checkpoint
  (``experts.gate_up_proj [E, hidden, 2 * inter]``, gate columns then up columns, and
  ``experts.down_proj [E, inter, hidden]``). The other layers' MLP is a SwiGLU of
  ``intermediate_size_mlp``.

Checkpoints name each layer's MLP ``feed_forward``; here it is ``mlp`` (the Llama layer's).
Tensor parallel as :mod:`.sparse_moe`: experts split by intermediate columns (or whole,
per rank, with expert parallelism), the router whole, the shared expert and the dense MLP
split by columns; one all-reduce per block.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.llama import (
    DecoderSpec,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)
from chassis.builtin_plugins.models.smollm3 import rope_layers
from chassis.builtin_plugins.models.text_only import TextOnlyWeights
from chassis.core import parallel_state
from chassis.core.layers.moe import FusedMoE
from chassis.core.layers.rotary import RotaryEmbedding, rope_parameters
from chassis.core.model_interface import ModelBuildContext

CHUNKED_ATTENTION = "chunked_attention"
FULL_ATTENTION = "full_attention"
#: ``<layer>.mlp.experts.gate_up_proj`` / ``down_proj``: all experts of a block, stacked
_STACKED_EXPERTS = re.compile(r"^(?P<block>.+\.mlp)\.experts\.(?P<proj>gate_up_proj|down_proj)$")


def chunked_layers(hf_config: Any) -> frozenset[int]:
    """The layers that attend in chunks: those ``layer_types`` marks ``chunked_attention``,
    or, without ``layer_types``, HF's default (the RoPE layers, when ``attention_chunk_size``
    is set). ``ValueError`` for another layer type or a list of the wrong length."""
    num_layers = int(hf_config.num_hidden_layers)
    layer_types = getattr(hf_config, "layer_types", None)
    if not layer_types:
        if getattr(hf_config, "attention_chunk_size", None) is None:
            return frozenset()
        return frozenset(i for i, rope in enumerate(rope_layers(hf_config)) if rope)
    if len(layer_types) != num_layers:
        raise ValueError(
            f"config layer_types has {len(layer_types)} entries for {num_layers} layers "
            "(num_hidden_layers); fix config.json"
        )
    bad = sorted({kind for kind in layer_types} - {CHUNKED_ATTENTION, FULL_ATTENTION})
    if bad:
        raise ValueError(
            f"config layer_types has {bad[0]!r}; Llama 4 layers are {CHUNKED_ATTENTION!r} "
            f"or {FULL_ATTENTION!r}"
        )
    chunked = frozenset(i for i, kind in enumerate(layer_types) if kind == CHUNKED_ATTENTION)
    if chunked and not getattr(hf_config, "attention_chunk_size", None):
        raise ValueError(
            "config layer_types marks chunked_attention layers but attention_chunk_size is "
            "not set; fix config.json"
        )
    return chunked


def moe_layers(hf_config: Any) -> frozenset[int]:
    """The layers whose MLP is a mixture of experts: ``moe_layers``, or every
    ``interleave_moe_layer_step``-th layer (``step - 1``, ``2 * step - 1``, ...)."""
    listed = getattr(hf_config, "moe_layers", None)
    num_layers = int(hf_config.num_hidden_layers)
    if listed is not None:
        return frozenset(int(i) for i in listed)
    step = int(getattr(hf_config, "interleave_moe_layer_step", 1) or 1)
    if step < 1:
        raise ValueError(f"config interleave_moe_layer_step must be >= 1, got {step}")
    return frozenset(range(step - 1, num_layers, step))


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each row of the last dim over its root mean square, in float32, weightless (HF's
    ``Llama4TextL2Norm``)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class Llama4Attention(LlamaAttention):
    """Llama's attention with Llama 4's per-layer position handling (the module docstring):
    RoPE then the weightless q/k norm on RoPE layers, position-scaled queries on NoPE ones.
    ``temperature``: ``(floor_scale, attn_scale)`` for a NoPE layer that tunes it, else
    ``None``."""

    def __init__(
        self,
        spec: DecoderSpec,
        rotary_emb: RotaryEmbedding,
        layer_idx: int,
        build_ctx: ModelBuildContext,
        *,
        use_rope: bool,
        qk_l2_norm: bool,
        temperature: tuple[float, float] | None,
        attention_chunk_size: int | None,
    ) -> None:
        super().__init__(
            spec, rotary_emb, layer_idx, build_ctx, attention_chunk_size=attention_chunk_size
        )
        self.use_rope = use_rope
        self.qk_l2_norm = qk_l2_norm and use_rope
        self.temperature = None if use_rope else temperature
        self.eps = spec.rms_norm_eps

    def encode_positions(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.use_rope:
            # in float32 and rounded once, as HF's complex multiplication
            q_rot, k_rot = self.rotary_emb(positions, q.float(), k.float())
            q, k = q_rot.to(q.dtype), k_rot.to(k.dtype)
            if self.qk_l2_norm:
                q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
            return q, k
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            pos = positions.float() + 1.0
            scales = torch.log1p(torch.floor(pos / floor_scale)) * attn_scale + 1.0
            q = (q * scales[:, None, None]).to(q.dtype)
        return q, k


class Llama4MoE(nn.Module):
    """``router``, ``experts`` (input-scaled sigmoid top-k) and ``shared_expert``:
    ``forward(x [T, hidden]) -> [T, hidden]``, summed over the tensor-parallel group."""

    def __init__(self, spec: DecoderSpec, hf_config: Any) -> None:
        super().__init__()
        num_experts = int(hf_config.num_local_experts)
        self.top_k = int(hf_config.num_experts_per_tok)
        inter = int(hf_config.intermediate_size)
        self.router = nn.Linear(spec.hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(
            num_experts,
            self.top_k,
            spec.hidden_size,
            inter,
            renormalize=False,  # (unused: routed here)
            round_weights_to_model_dtype=True,
            intermediate_size_field="intermediate_size",
        )
        _, share = parallel_state.shard(inter, "intermediate_size")
        self.shared_expert = LlamaMLP(spec, share, reduce_output=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        weights = torch.sigmoid(top.float()).to(x.dtype)
        routed = self.experts.run_routed(x, weights, ids, weights_on_input=True)
        # Each rank holds some intermediate columns (or whole experts): partial sums add up.
        return parallel_state.all_reduce(self.shared_expert(x) + routed)


class Llama4ForCausalLM(LlamaForCausalLM):
    """``Llama4ForCausalLM`` checkpoints (a Llama 4 language model on its own).

    Refused: ``hidden_act`` other than ``silu``, RoPE types :mod:`~chassis.core.layers.rotary`
    lacks, unknown ``layer_types``."""

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        # HF's Llama 4 rotates pairs (2i, 2i + 1) as complex numbers
        rope = {**rope_parameters(hf_config), "interleaved": True}
        return DecoderSpec.from_config(hf_config, sliding_window=None, rope=rope)

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> nn.Module:
        cfg = self.hf_config
        use_rope = rope_layers(cfg)[layer_idx]
        chunk = None
        if layer_idx in chunked_layers(cfg):
            chunk = int(cfg.attention_chunk_size)
            if build_ctx.max_model_len is not None and chunk >= build_ctx.max_model_len:
                chunk = None  # no sequence reaches a second chunk: full attention
        temperature = None
        if getattr(cfg, "attn_temperature_tuning", False):
            temperature = (float(cfg.floor_scale), float(cfg.attn_scale))
        attention = Llama4Attention(
            self.spec,
            rotary_emb,
            layer_idx,
            build_ctx,
            use_rope=use_rope,
            qk_l2_norm=bool(getattr(cfg, "use_qk_norm", False)),
            temperature=temperature,
            attention_chunk_size=chunk,
        )
        return LlamaDecoderLayer(
            self.spec,
            rotary_emb,
            layer_idx,
            build_ctx,
            self.make_mlp(layer_idx),
            norm_class=self.norm_class,
            self_attn=attention,
        )

    def make_mlp(self, layer_idx: int) -> nn.Module:
        if layer_idx in moe_layers(self.hf_config):
            return Llama4MoE(self.spec, self.hf_config)
        size = int(self.hf_config.intermediate_size_mlp)
        _, share = parallel_state.shard(size, "intermediate_size_mlp")
        return LlamaMLP(self.spec, share)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As :meth:`LlamaForCausalLM.load_weights`, each ``feed_forward`` read as ``mlp``, and
        the stacked ``experts.gate_up_proj`` / ``experts.down_proj`` cut into each expert's
        gate, up and down matrices (those of the experts this rank holds); a block's experts
        count as filled once both arrived."""
        modules = dict(self.named_modules())
        expert_shards: dict[str, set[str]] = {}

        def dense_tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.replace(".feed_forward.", ".mlp.")
                match = _STACKED_EXPERTS.match(name)
                if match is None:
                    yield name, tensor
                    continue
                experts = modules.get(f"{match['block']}.experts")
                if not isinstance(experts, FusedMoE):
                    raise ValueError(
                        f"checkpoint tensor {name!r} has no counterpart in "
                        f"{type(self).__name__} (is the layer in moe_layers?)"
                    )
                keys = _load_stacked(experts, match["proj"], tensor, name)
                expert_shards.setdefault(match["block"], set()).update(keys)

        filled = super().load_weights(dense_tensors())
        for name, experts in modules.items():
            if isinstance(experts, FusedMoE):
                block = name.removesuffix(".experts")
                if expert_shards.get(block, set()) >= experts.shards_needed():
                    filled |= {f"{name}.w13", f"{name}.w2"}
        return filled


def _load_stacked(experts: FusedMoE, proj: str, tensor: torch.Tensor, name: str) -> set[str]:
    """Copy a stacked expert tensor into ``experts`` (its held experts); the shard keys."""
    hidden, inter = experts.w13.shape[2], experts.full_intermediate_size
    expected = (
        (experts.num_experts, hidden, 2 * inter)
        if proj == "gate_up_proj"
        else (experts.num_experts, inter, hidden)
    )
    if tuple(tensor.shape) != expected:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected "
            f"{expected} (does config.json match the weights?)"
        )
    keys = set()
    for e in range(experts.expert_start, experts.expert_start + experts.num_local_experts):
        if proj == "gate_up_proj":
            keys.add(experts.load_expert_weight(e, "gate", tensor[e, :, :inter].t()))
            keys.add(experts.load_expert_weight(e, "up", tensor[e, :, inter:].t()))
        else:
            keys.add(experts.load_expert_weight(e, "down", tensor[e].t()))
    return keys


class Llama4ForConditionalGeneration(TextOnlyWeights, Llama4ForCausalLM):
    """``Llama4ForConditionalGeneration`` checkpoints (Llama 4 Scout / Maverick) served as
    text only: the language model of the checkpoint's ``text_config``. Hub files name it
    ``language_model.model.*`` and ``language_model.lm_head.*``; the layout
    ``model.language_model.*`` is read too. The vision model and the projector are never
    read, and images are not accepted."""

    language_model_prefixes = (
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "model."),
    )
    vision_prefixes = (
        "vision_model.",
        "multi_modal_projector.",
        "model.vision_model.",
        "model.multi_modal_projector.",
    )


__all__ = ["Llama4ForCausalLM", "Llama4ForConditionalGeneration", "chunked_layers", "moe_layers"]
