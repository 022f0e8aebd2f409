"""DeepSeek-V2 (V2, V2-Lite, V2.5): multi-head latent attention (MLA) and a mixture of
experts with shared experts. :mod:`.deepseek_v3` reuses everything here but the router;
:mod:`.glm4_moe` reuses the decoder around the attention (:class:`DeepseekMoeForCausalLM`).

As HF transformers' ``DeepseekV2`` code defines it, a layer keeps Llama's pre-norm layout
(``h += attn(input_layernorm(h))``, ``h += mlp(post_attention_layernorm(h))``) and differs in
its attention and its MLP:

- **Attention (MLA)**, per token, with ``H`` heads:

  - ``q``: ``q_proj(x)``, or with ``q_lora_rank`` set the low-rank path
    ``q_b_proj(q_a_layernorm(q_a_proj(x)))``; ``H`` heads of ``qk_nope_head_dim +
    qk_rope_head_dim``, each split into a part without position (``q_nope``) and one with
    RoPE (``q_pe``).
  - ``kv_a_proj_with_mqa(x)`` gives a latent of ``kv_lora_rank`` and one ``k_pe`` of
    ``qk_rope_head_dim`` shared by all heads; ``kv_b_proj(kv_a_layernorm(latent))`` expands
    the latent into each head's ``k_nope`` (``qk_nope_head_dim``) and value
    (``v_head_dim``).
  - Keys are ``k_nope ‖ rope(k_pe)``, queries ``q_nope ‖ rope(q_pe)``: RoPE rotates only
    the ``qk_rope_head_dim`` part, in the interleaved layout (pairs ``2i, 2i + 1``: V2's
    complex multiplication; V3's ``rope_interleave``), over a table of ``qk_rope_head_dim``
    (HF's config sets ``head_dim`` to it).
  - The softmax scale is ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times
    ``mscale(factor, mscale_all_dim) ** 2`` when the RoPE is scaled and the config has
    ``mscale_all_dim`` (DeepSeek YaRN; ``mscale`` and ``mscale_all_dim`` also set YaRN's
    cos/sin factor, ``core/layers/rotary.py``).
  - The low-rank norms ``q_a_layernorm`` and ``kv_a_layernorm`` use eps 1e-6 whatever
    ``rms_norm_eps`` says (as HF). ``attention_bias`` puts biases on ``q_a_proj``,
    ``kv_a_proj_with_mqa`` and ``o_proj`` only.

- **MLP**: layers ``0 .. first_k_dense_replace - 1`` have a dense SwiGLU MLP
  (``intermediate_size``); the others a mixture of experts: a router ``gate`` (a bias-free
  float32 weight, applied in float32) picks ``num_experts_per_tok`` of ``n_routed_experts``
  SwiGLU experts (``moe_intermediate_size``), and ``shared_experts`` (one SwiGLU MLP of
  ``n_shared_experts * moe_intermediate_size``, ungated) sees every token. V2 routes by a
  softmax over all experts, then ``topk_method`` ``greedy`` (the top k) or
  ``group_limited_greedy`` (only the experts of the ``topk_group`` of ``n_group`` groups
  with the highest best score); the chosen probabilities are multiplied by
  ``routed_scaling_factor``, never renormalized (HF's V2 ignores ``norm_topk_prob``). The
  dense and shared MLPs take ``mlp_bias``.

**KV cache: the latent.** The paged cache holds, per token and layer, one vector of
``kv_lora_rank + qk_rope_head_dim`` (576 for V2-Lite, V3 and Kimi K2):
``kv_a_layernorm(latent) ‖ rope(k_pe)``, the key of one KV head that every query head
shares (multi-query attention) and its value too. ``kv_b_proj`` is absorbed rather than
applied to the latent: with ``W_UK[h]`` / ``W_UV[h]`` the ``k_nope`` / value rows of head
``h`` in ``kv_b_proj.weight`` (``[qk_nope_head_dim, kv_lora_rank]`` /
``[v_head_dim, kv_lora_rank]``),

- the query of head ``h`` is ``W_UK[h]^T q_nope[h] ‖ rope(q_pe[h])``, so its dot product with
  the cached vector is ``q_nope[h] . k_nope[h] + q_pe[h] . rope(k_pe)``, the expanded form's
  score (same softmax scale);
- the first ``kv_lora_rank`` columns of head ``h``'s attention output (the softmax-weighted
  latents) times ``W_UV[h]^T`` are its value output, then ``o_proj``.

The two matrices are views of ``kv_b_proj.weight`` taken at every forward (batched
matmuls), so loading, tensor-parallel shares and sleep mode's weight release work on the
one parameter. Since every layer passes the same tensor as key and value
(:attr:`DeepseekV2ForCausalLM.kv_cache_values_are_keys`), the runner stores one plane where
the backend allows (``AttentionBackend.supports_aliased_kv_planes``). Absorbed attention is
``kv_lora_rank + qk_rope_head_dim`` wide per head; for prefill chunks the layer instead
expands the request's cached latent with ``kv_b_proj`` and attends over heads of
``qk_head_dim`` (:mod:`.mla_prefill`: which requests, by a FLOP rule or
``CHASSIS_MLA_PREFILL``), as vLLM does; decodes stay absorbed.
The model presents the runner a config whose ``head_dim`` and ``num_key_value_heads``
describe this cache (:meth:`DeepseekV2ForCausalLM.kv_cache_config`).

Tensor parallel: each rank keeps ``1/N`` of the heads (rows of ``q_proj``/``q_b_proj`` and
``kv_b_proj``, columns of ``o_proj``; ``o_proj``'s bias on rank 0), the low-rank
projections, their norms and the router whole, and the whole latent cache (its one KV head
replicated); experts and the shared and dense MLPs split
their intermediate columns as the other MoE models do (``--enable-expert-parallel``: whole
experts per rank). Attention and the MLP all-reduce once each.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chassis.builtin_plugins.attention.torch_paged import write_kv_cache
from chassis.builtin_plugins.models.llama import (
    DecoderSpec,
    LlamaDecoderLayer,
    LlamaMLP,
)
from chassis.builtin_plugins.models.mla_prefill import (
    MlaShape,
    StepPlan,
    mla_prefill_mode,
    plan_step,
    read_cache_rows,
    varlen_causal_attention,
)
from chassis.builtin_plugins.models.sparse_moe import MoeSpec, SparseMoeForCausalLM
from chassis.core import parallel_state
from chassis.core.attention import AttentionMetadata, ForwardContext
from chassis.core.layers.attention import Attention
from chassis.core.layers.moe import FusedMoE, fused_experts_grouped, localize_expert_ids
from chassis.core.layers.norm import RMSNorm
from chassis.core.layers.rotary import RotaryEmbedding, rope_parameters
from chassis.core.model_interface import LoRASlice, ModelBuildContext

#: HF's ``DeepseekV2RMSNorm(q_lora_rank)`` / ``(kv_lora_rank)``: the default eps, not the config's
LOW_RANK_NORM_EPS = 1e-6
#: ``model.layers.<i>.`` at the start of a checkpoint name
_LAYER_PREFIX = re.compile(r"^model\.layers\.(\d+)\.")


def _int_field(hf_config: Any, field: str) -> int:
    value = getattr(hf_config, field, None)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config {field} must be a positive integer; got {value!r}")
    return value


@dataclass(frozen=True)
class MlaSpec:
    """The shapes of one multi-head latent attention layer (whole, or one rank's heads)."""

    hidden_size: int
    num_heads: int
    #: ``None``: ``q_proj`` straight from the hidden states
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    #: the softmax scale (with DeepSeek YaRN's ``mscale_all_dim`` correction)
    scale: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_head_dim(self) -> int:
        """The width of the paged cache's one KV head: the latent and ``k_pe``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_config(cls, hf_config: Any) -> MlaSpec:
        q_lora_rank = getattr(hf_config, "q_lora_rank", None)
        if q_lora_rank is not None:
            q_lora_rank = _int_field(hf_config, "q_lora_rank")
        qk_nope = getattr(hf_config, "qk_nope_head_dim", None)
        if not isinstance(qk_nope, int) or qk_nope < 0:
            raise ValueError(f"config qk_nope_head_dim must be an integer >= 0; got {qk_nope!r}")
        rope_dim = _int_field(hf_config, "qk_rope_head_dim")
        if rope_dim % 2:
            raise ValueError(f"config qk_rope_head_dim must be even; got {rope_dim}")
        params = rope_parameters(hf_config)
        partial = params.get("partial_rotary_factor")
        if partial is not None and float(partial) != 1.0:
            raise ValueError(
                f"config partial_rotary_factor {partial} is not supported: DeepSeek rotates "
                "the whole qk_rope_head_dim part of each head"
            )
        qk_head_dim = qk_nope + rope_dim
        return cls(
            hidden_size=int(hf_config.hidden_size),
            num_heads=_int_field(hf_config, "num_attention_heads"),
            q_lora_rank=q_lora_rank,
            kv_lora_rank=_int_field(hf_config, "kv_lora_rank"),
            qk_nope_head_dim=qk_nope,
            qk_rope_head_dim=rope_dim,
            v_head_dim=_int_field(hf_config, "v_head_dim"),
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            scale=qk_head_dim**-0.5 * mscale_correction(params),
        )


def mscale_correction(params: dict[str, Any]) -> float:
    """The factor HF's ``yarn_apply_mscale`` multiplies the softmax scale by:
    ``(0.1 * mscale_all_dim * ln(factor) + 1) ** 2`` when the RoPE is scaled (any type but
    ``default``) with ``mscale_all_dim`` set and ``factor`` above 1, else 1."""
    mscale_all_dim = params.get("mscale_all_dim")
    if params.get("rope_type", "default") == "default" or not mscale_all_dim:
        return 1.0
    factor = float(params["factor"])
    if factor <= 1:
        return 1.0
    mscale = 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
    return mscale * mscale


class LatentUpProjection(nn.Linear):
    """``kv_b_proj``: loaded as HF's ``nn.Linear`` but never called; MLA reads its weight as
    per-head matrices (:class:`MultiHeadLatentAttention`). A class of its own so that what
    replaces plain ``nn.Linear`` layers (4-bit packing, the CPU's packed bf16 layers) leaves
    it a dense weight."""


class MultiHeadLatentAttention(nn.Module):
    """MLA (the module docstring) over this rank's heads, on the latent cache:
    ``forward(positions, x, ctx)``, summed over the tensor-parallel group. Module names are
    HF's. A step's requests run absorbed or expanded as :func:`.mla_prefill.plan_step`
    splits them (:attr:`prefill_mode`); both write the same latent to the cache."""

    def __init__(
        self,
        spec: MlaSpec,
        rotary_emb: RotaryEmbedding,
        layer_idx: int,
        build_ctx: ModelBuildContext,
    ) -> None:
        super().__init__()
        #: this rank's heads ``[first_head, first_head + num_heads)``
        self.first_head, self.num_heads = parallel_state.shard(
            spec.num_heads, "num_attention_heads"
        )
        self.spec = spec
        heads, hidden = self.num_heads, spec.hidden_size
        q_rows = heads * spec.qk_head_dim
        if spec.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_rows, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, spec.q_lora_rank, bias=spec.attention_bias)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, LOW_RANK_NORM_EPS)
            self.q_b_proj = nn.Linear(spec.q_lora_rank, q_rows, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            hidden, spec.kv_lora_rank + spec.qk_rope_head_dim, bias=spec.attention_bias
        )
        self.kv_a_layernorm = RMSNorm(spec.kv_lora_rank, LOW_RANK_NORM_EPS)
        self.kv_b_proj = LatentUpProjection(
            spec.kv_lora_rank, heads * (spec.qk_nope_head_dim + spec.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(heads * spec.v_head_dim, hidden, bias=spec.attention_bias)
        self.rotary_emb = rotary_emb  # over qk_rope_head_dim, shared by all layers
        # one KV head (the latent) shared by every query head; q . k is the expanded form's
        # score, so the softmax scale is unchanged
        self.attn = Attention(
            heads, spec.cache_head_dim, 1, spec.scale, layer_idx, build_ctx.attention_backend
        )
        self.layer_idx = layer_idx
        #: which requests run the expanded prefill (:mod:`.mla_prefill`: ``auto``,
        #: ``expanded`` or ``absorbed``), from ``CHASSIS_MLA_PREFILL`` when built
        self.prefill_mode = mla_prefill_mode()
        self.shape = MlaShape(
            spec.kv_lora_rank, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        )

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        spec, heads = self.spec, self.num_heads
        num_tokens = hidden_states.shape[0]
        nope, rope_dim, rank = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.kv_lora_rank
        if spec.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(num_tokens, heads, spec.qk_head_dim)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([rank, rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        # RoPE on the position part only (contiguous copies: a kernel may rotate in place)
        q_pe, k_pe = self.rotary_emb(
            positions,
            q[..., nope:].contiguous(),
            k_pe.reshape(num_tokens, 1, rope_dim).contiguous(),
        )
        cached = torch.cat((latent, k_pe.view(num_tokens, rope_dim)), dim=-1)  # [T, 576-like]
        # (a traced graph reads no step metadata: under torch.compile every step is absorbed)
        plan = None if torch.compiler.is_compiling() else self._plan(ctx)
        if plan is None:  # every request absorbed: the one backend call of the whole step
            values = self._absorbed(q[..., :nope], q_pe, cached, ctx)
        else:
            kv_cache = ctx.kv_caches[self.layer_idx]
            values = q.new_zeros(num_tokens, heads, spec.v_head_dim)
            if plan.absorbed_rows is not None:
                rows = plan.absorbed_rows
                values[rows] = self._absorbed(
                    q[rows, :, :nope], q_pe[rows], cached[rows], ctx, plan.absorbed_metadata
                )
            rows = plan.expanded_rows
            values[rows] = self._expanded(
                q[rows, :, :nope], q_pe[rows], cached[rows], kv_cache, plan
            )
        out = values.reshape(num_tokens, heads * spec.v_head_dim)
        # Each rank holds some heads: o_proj's partial sums add up to the whole output.
        return parallel_state.all_reduce(self.o_proj(out))

    def _plan(self, ctx: ForwardContext) -> StepPlan | None:
        """The step's split between the forms (``None``: all absorbed)."""
        block_size = ctx.kv_caches[self.layer_idx].shape[2]
        metadata = ctx.metadata_for(self.layer_idx)
        return plan_step(metadata, self.shape, self.prefill_mode, block_size)

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's heads' rows of ``kv_b_proj``: ``W_UK [H, nope, rank]``,
        ``W_UV [H, v, rank]`` (views)."""
        spec = self.spec
        weight = self.kv_b_proj.weight.view(
            self.num_heads, spec.qk_nope_head_dim + spec.v_head_dim, spec.kv_lora_rank
        )
        w_uk, w_uv = weight.split([spec.qk_nope_head_dim, spec.v_head_dim], dim=1)
        return w_uk, w_uv

    def _absorbed(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        cached: torch.Tensor,
        ctx: ForwardContext,
        metadata: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """The absorbed form (the module docstring) on ``q_nope [T, H, nope]``, ``q_pe [T, H,
        rope]`` and the tokens' cache vectors ``cached [T, rank + rope]``, which the backend
        writes: ``[T, H, v]``. ``metadata``: a split step's absorbed requests (the backend
        is called directly with it), else the layer's (through :class:`Attention`)."""
        num_tokens, rank = q_nope.shape[0], self.spec.kv_lora_rank
        w_uk, w_uv = self._up_projections()
        # q_lat[t, h] = W_UK[h]^T q_nope[t, h]: [H, T, nope] @ [H, nope, rank] -> [H, T, rank]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        query = torch.cat((q_lat, q_pe), dim=-1)  # [T, H, rank + rope]
        if metadata is None:
            out = self.attn(query, cached, cached, ctx)
        else:
            kv = cached.view(num_tokens, 1, -1)
            out = self.attn.backend.forward(query, kv, kv, ctx.kv_caches[self.layer_idx], metadata)
        out = out.view(num_tokens, self.num_heads, -1)
        # each head's value output: W_UV[h] times its weighted latent (the first rank columns)
        # [H, T, rank] @ [H, rank, v] -> [H, T, v]
        return torch.bmm(out[..., :rank].transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _expanded(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        cached: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: StepPlan,
    ) -> torch.Tensor:
        """The expanded form (:mod:`.mla_prefill`) for the plan's expanded requests, whose
        tokens these are: their cache vectors written, each request's whole context read
        back and expanded by ``kv_b_proj``, causal attention over heads of ``nope + rope``
        keys and ``v`` values: ``[T, H, v]``."""
        spec, heads = self.spec, self.num_heads
        backend = self.attn.backend
        kv = cached.view(cached.shape[0], 1, -1)
        # written as the backend would (the latent, quantized by its scales): the cache's
        # layout and 8-bit rule are the AttentionBackend contract's whichever backend runs,
        # and that interface has no write-only method (read_cache_rows reads back the same way)
        write_kv_cache(
            kv_cache, kv, kv, plan.expanded_slots, k_scale=backend.k_scale, v_scale=backend.v_scale
        )
        context = read_cache_rows(kv_cache, plan.context_slots, backend.k_scale).to(cached.dtype)
        latent, k_pe = context.split([spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1)
        # [L, rank] -> [L, H, nope + v]: every context token's per-head key part and value
        k_nope, value = (
            F.linear(latent, self.kv_b_proj.weight)
            .view(-1, heads, spec.qk_nope_head_dim + spec.v_head_dim)
            .split([spec.qk_nope_head_dim, spec.v_head_dim], dim=-1)
        )
        key = torch.cat((k_nope, k_pe[:, None, :].expand(-1, heads, -1)), dim=-1)
        query = torch.cat((q_nope, q_pe), dim=-1)
        return varlen_causal_attention(
            query, key, value, plan.expanded_query_lens, plan.expanded_seq_lens, spec.scale
        )

    @torch.no_grad()
    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> str:
        """Copy checkpoint tensor ``name`` (relative to ``self_attn``, e.g.
        ``"kv_b_proj.weight"``) in, cut to this rank's heads; return the parameter's name
        relative to this module. A name or shape that does not fit is a ``ValueError``."""
        params = dict(self.named_parameters())
        param = params.get(name)
        if param is None:
            raise ValueError(
                f"attention tensor {name!r} has no counterpart in this DeepSeek attention "
                f"(q_lora_rank {self.spec.q_lora_rank}); does config.json match the weights?"
            )
        tensor = self._tensor_parallel_slice(name, tensor)
        if param.shape != tensor.shape:
            raise ValueError(
                f"attention tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                f"{tuple(param.shape)} (does config.json match the weights?)"
            )
        param.copy_(tensor)
        return name

    def _tensor_parallel_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if parallel_state.tp_size() == 1:
            return tensor
        spec, first, heads = self.spec, self.first_head, self.num_heads
        if name in ("q_proj.weight", "q_b_proj.weight"):
            rows = spec.qk_head_dim
            return tensor[first * rows : (first + heads) * rows]
        if name == "kv_b_proj.weight":
            rows = spec.qk_nope_head_dim + spec.v_head_dim
            return tensor[first * rows : (first + heads) * rows]
        if name == "o_proj.weight":
            cols = spec.v_head_dim
            return tensor[:, first * cols : (first + heads) * cols]
        if name == "o_proj.bias":  # the partial sums add it once
            return tensor if parallel_state.tp_rank() == 0 else torch.zeros_like(tensor)
        return tensor  # the low-rank projections and their norms are whole on every rank


@dataclass(frozen=True)
class RouterSpec:
    """How a DeepSeek router picks experts (the module docstrings of V2 and V3)."""

    num_experts: int
    top_k: int
    #: ``"greedy"`` or ``"group_limited_greedy"`` (V2, softmax), ``"noaux_tc"`` (V3, sigmoid)
    topk_method: str
    #: the expert groups, and how many of them a token may choose from (group-limited)
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float


class DeepseekV2Router(nn.Module):
    """V2's router: ``weight [E, hidden]`` (float32, as HF keeps it), applied in float32, a
    softmax over all experts, then the top k (``greedy``), or the top k among the experts of
    the ``topk_group`` groups whose best score is highest (``group_limited_greedy``); the
    chosen probabilities times ``routed_scaling_factor``.
    ``forward(x) -> (weights float32 [T, k], ids int64 [T, k])``."""

    def __init__(self, spec: RouterSpec, hidden_size: int) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(
            torch.empty(spec.num_experts, hidden_size, dtype=torch.float32), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if spec.topk_method == "group_limited_greedy":
            group_scores = scores.view(-1, spec.n_group, spec.num_experts // spec.n_group)
            keep = group_expert_mask(group_scores.amax(dim=-1), spec)
            scores = scores.masked_fill(~keep, 0.0)
        weights, ids = torch.topk(scores, spec.top_k, dim=-1)
        return weights * spec.routed_scaling_factor, ids


def group_expert_mask(group_scores: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """``[T, E]`` bool: the experts of each token's ``topk_group`` best groups."""
    group_idx = torch.topk(group_scores, spec.topk_group, dim=-1)[1]
    chosen = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    per_group = spec.num_experts // spec.n_group
    return chosen.unsqueeze(-1).expand(-1, spec.n_group, per_group).reshape(-1, spec.num_experts)


class RoutedExperts(FusedMoE):
    """:class:`FusedMoE`'s experts (stacked weights, tensor/expert-parallel shares, kernels
    and loading) run on routing computed outside: ``forward(x, weights, ids)``."""

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        if self.num_local_experts != self.num_experts:
            ids = localize_expert_ids(ids, self.expert_start, self.num_local_experts)
        fused = self._kernel()
        if fused is not None:
            return fused(x, self.w13, self.w2, weights, ids)
        return fused_experts_grouped(x, self.w13, self.w2, weights, ids)


class DeepseekMoE(nn.Module):
    """Router ``gate``, routed ``experts`` and ungated ``shared_experts`` (HF's names):
    ``forward(x [T, hidden]) -> [T, hidden]``, summed over the tensor-parallel group."""

    def __init__(self, spec: DecoderSpec, moe: MoeSpec, router: nn.Module) -> None:
        super().__init__()
        self.gate = router
        self.experts = RoutedExperts(
            moe.num_experts,
            moe.top_k,
            spec.hidden_size,
            moe.intermediate_size,
            renormalize=False,  # the router decides (unused: it routes itself)
            round_weights_to_model_dtype=False,  # HF scales the experts' outputs in float32
        )
        self.shared_experts: LlamaMLP | None = None
        if moe.shared_expert_intermediate_size:
            _, share = parallel_state.shard(
                moe.shared_expert_intermediate_size, "n_shared_experts * moe_intermediate_size"
            )
            # spec.mlp_bias: V2's mlp_bias, which HF's shared experts take too
            self.shared_experts = LlamaMLP(spec, share, reduce_output=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        # Each rank holds some intermediate columns (or whole experts): partial sums add up.
        return parallel_state.all_reduce(out)


class DeepseekMoeForCausalLM(SparseMoeForCausalLM):
    """The decoder DeepSeek-V2/V3 and GLM-4.5 share around their attention: dense SwiGLU
    MLPs in layers ``0 .. first_k_dense_replace - 1``, :class:`DeepseekMoE` blocks after
    them (a router of :meth:`make_router`, routed and shared experts), and the layers past
    ``num_hidden_layers`` in a checkpoint (multi-token prediction) left unread. Subclasses
    choose the attention (:meth:`decoder_spec`, :meth:`make_layer`) and the routing
    (:attr:`topk_methods`, :attr:`scoring_func`, :meth:`router_spec`, :meth:`make_router`)."""

    #: the ``topk_method`` values this router implements (the first is the default)
    topk_methods: tuple[str, ...] = ("greedy", "group_limited_greedy")
    #: the ``scoring_func`` this router implements (a config may name it; HF ignores it)
    scoring_func = "softmax"

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        #: the routing of every sparse layer, checked before anything is built
        self.router = self.router_spec(hf_config)
        super().__init__(hf_config, build_ctx)

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoeSpec:
        first_dense = getattr(hf_config, "first_k_dense_replace", 0) or 0
        if not isinstance(first_dense, int) or first_dense < 0:
            raise ValueError(
                f"config first_k_dense_replace must be an integer >= 0; got {first_dense!r}"
            )
        freq = getattr(hf_config, "moe_layer_freq", 1)
        if freq not in (None, 1):
            raise ValueError(
                f"config moe_layer_freq {freq!r} is not supported (only 1: every layer from "
                "first_k_dense_replace on is sparse, as HF transformers builds it)"
            )
        moe_inter = _int_field(hf_config, "moe_intermediate_size")
        shared = getattr(hf_config, "n_shared_experts", 0) or 0
        if not isinstance(shared, int) or shared < 0:
            raise ValueError(f"config n_shared_experts must be an integer >= 0; got {shared!r}")
        return MoeSpec(
            num_experts=_int_field(hf_config, "n_routed_experts"),
            top_k=_int_field(hf_config, "num_experts_per_tok"),
            intermediate_size=moe_inter,
            renormalize=False,
            round_weights_to_model_dtype=False,
            dense_layers=frozenset(range(first_dense)),
            shared_expert_intermediate_size=shared * moe_inter,
        )

    @classmethod
    def router_spec(cls, hf_config: Any) -> RouterSpec:
        """The routing fields, checked: an unsupported ``topk_method`` or ``scoring_func``,
        groups that do not split the experts, or (V2) ``norm_topk_prob`` is a
        ``ValueError`` naming the field."""
        scoring = getattr(hf_config, "scoring_func", None)
        if scoring is not None and scoring != cls.scoring_func:
            raise ValueError(
                f"config scoring_func {scoring!r} is not supported by {cls.__name__} "
                f"(only {cls.scoring_func!r})"
            )
        method = getattr(hf_config, "topk_method", None) or cls.topk_methods[0]
        if method not in cls.topk_methods:
            raise ValueError(
                f"config topk_method {method!r} is not supported by {cls.__name__}; "
                f"supported: {', '.join(cls.topk_methods)}"
            )
        num_experts = _int_field(hf_config, "n_routed_experts")
        n_group, topk_group = 1, 1  # a subclass's method reads its groups itself (V3)
        if method == "group_limited_greedy":
            n_group = _int_field(hf_config, "n_group")
            topk_group = _int_field(hf_config, "topk_group")
            if num_experts % n_group or topk_group > n_group:
                raise ValueError(
                    f"config n_group {n_group} must divide n_routed_experts {num_experts} "
                    f"and be at least topk_group {topk_group}"
                )
        top_k = _int_field(hf_config, "num_experts_per_tok")
        if top_k > num_experts // n_group * topk_group:
            raise ValueError(
                f"config num_experts_per_tok {top_k} exceeds the experts of topk_group "
                f"{topk_group} groups ({num_experts // n_group * topk_group})"
            )
        norm_topk_prob = bool(getattr(hf_config, "norm_topk_prob", False))
        if norm_topk_prob and method in ("greedy", "group_limited_greedy"):
            raise ValueError(
                "config norm_topk_prob true is not supported for DeepSeek-V2: HF transformers' "
                "DeepseekV2 ignores it (DeepSeek's own code renormalized), so no result would "
                "match both; the released V2 checkpoints set it false"
            )
        return RouterSpec(
            num_experts=num_experts,
            top_k=top_k,
            topk_method=method,
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=norm_topk_prob,
            routed_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0)),
        )

    def make_router(self) -> nn.Module:
        """The ``gate`` of a sparse layer (``forward(x) -> (weights, ids)``)."""
        return DeepseekV2Router(self.router, self.spec.hidden_size)

    def make_mlp(self, layer_idx: int) -> nn.Module:
        moe = self.moe_spec(self.hf_config)
        if moe.is_sparse(layer_idx):
            return DeepseekMoE(self.spec, moe, self.make_router())
        return LlamaMLP(self.spec)

    def needs_checkpoint_tensor(self, name: str) -> bool:
        """Not the layers past ``num_hidden_layers`` (DeepSeek-V3's multi-token prediction
        module, ``model.layers.61``, which HF does not load either), nor other ranks'
        experts."""
        return self._own_layer(name) and super().needs_checkpoint_tensor(name)

    def _own_layer(self, name: str) -> bool:
        match = _LAYER_PREFIX.match(name)
        return match is None or int(match[1]) < len(self.model.layers)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As :meth:`SparseMoeForCausalLM.load_weights`, the layers past
        ``num_hidden_layers`` skipped."""
        return super().load_weights((n, t) for n, t in weights if self._own_layer(n))


class DeepseekV2ForCausalLM(DeepseekMoeForCausalLM):
    """``DeepseekV2ForCausalLM`` checkpoints (DeepSeek-V2, V2-Lite, V2.5; the module
    docstring). Subclasses change the routing (:meth:`router_spec`, :meth:`make_router`)
    and the RoPE layout (:meth:`rope_interleaved`)."""

    #: MLA's projections load into modules of their own names; only the dense and shared
    #: MLPs merge gate and up
    merged_projections = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
    #: every layer passes its cached latent vector as key and value: one cache plane holds it
    kv_cache_values_are_keys = True

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        self.mla = MlaSpec.from_config(hf_config)
        super().__init__(hf_config, build_ctx)
        #: the config the runner sizes the KV cache by (:meth:`kv_cache_config`)
        self.hf_config = self.kv_cache_config(hf_config)

    def kv_cache_config(self, hf_config: Any) -> Any:
        """A copy of the config whose ``head_dim`` and ``num_key_value_heads`` are the
        paged cache's: one KV head of ``kv_lora_rank + qk_rope_head_dim``, the latent (the
        module docstring), which tensor-parallel ranks replicate. HF's own ``head_dim`` is
        ``qk_rope_head_dim``, which the cache must not be sized by."""
        view = copy.copy(hf_config)
        view.head_dim = self.mla.cache_head_dim
        view.num_key_value_heads = 1
        return view

    @classmethod
    def rope_interleaved(cls, hf_config: Any) -> bool:
        """Whether RoPE pairs dimensions ``2i, 2i + 1`` (V2: always)."""
        return True

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        """The Llama options the layers share: ``head_dim`` is ``qk_rope_head_dim`` (the
        RoPE table's width), one KV head per head, no q/k/v bias; ``mlp_bias`` for the dense
        MLPs (V2)."""
        mla = MlaSpec.from_config(hf_config)
        rope = {**rope_parameters(hf_config), "interleaved": cls.rope_interleaved(hf_config)}
        return DecoderSpec.from_config(
            hf_config,
            num_kv_heads=mla.num_heads,
            head_dim=mla.qk_rope_head_dim,
            rope=rope,
            qkv_bias=False,
            o_bias=mla.attention_bias,
            mlp_bias=cls.dense_mlp_bias(hf_config),
            sliding_window=None,
        )

    @classmethod
    def dense_mlp_bias(cls, hf_config: Any) -> bool:
        """Whether the dense and shared MLPs have biases (V2: ``mlp_bias``)."""
        return bool(getattr(hf_config, "mlp_bias", False))

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> nn.Module:
        attention = MultiHeadLatentAttention(self.mla, rotary_emb, layer_idx, build_ctx)
        return LlamaDecoderLayer(
            self.spec,
            rotary_emb,
            layer_idx,
            build_ctx,
            self.make_mlp(layer_idx),
            norm_class=self.norm_class,
            self_attn=attention,
        )

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As :meth:`DeepseekMoeForCausalLM.load_weights`, with the attention tensors loaded
        by :meth:`MultiHeadLatentAttention.load_checkpoint_tensor` (this rank's heads)."""
        modules = dict(self.named_modules())
        attention_filled: set[str] = set()

        def other_tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if not self._own_layer(name):
                    continue
                prefix, sep, rest = name.partition(".self_attn.")
                attention = modules.get(prefix + ".self_attn") if sep else None
                if isinstance(attention, MultiHeadLatentAttention):
                    loaded = attention.load_checkpoint_tensor(rest, tensor)
                    attention_filled.add(f"{prefix}.self_attn.{loaded}")
                    continue
                yield name, tensor

        filled = super().load_weights(other_tensors())
        return filled | attention_filled

    def lora_slices(self, module_name: str, module: nn.Module) -> list[LoRASlice]:
        """The attention projections take no adapters (their shapes are MLA's, not the
        merged q/k/v this class's LoRA code cuts); the MLPs as Llama's."""
        if ".self_attn." in module_name:
            return []
        return super().lora_slices(module_name, module)
