"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral) for paged attention.

The building blocks here are shared by the Qwen2, Qwen3 and Phi-3 models, which differ only in
the options of :class:`DecoderSpec` (QKV bias, per-head q/k norm, sliding-window layers) and,
for Phi-3, in how the checkpoint names its projections; by the mixture-of-experts models
(their own MLPs, :meth:`LlamaForCausalLM.make_mlp`; gpt-oss also has attention sinks and its
own norm class, :attr:`LlamaForCausalLM.norm_class`); by OLMo 2 and Granite (their own decoder
layers, :meth:`LlamaForCausalLM.make_layer`); and by Gemma (its own decoder,
:meth:`LlamaForCausalLM.build_decoder`). Q/K/V and gate/up projections
are merged into one matmul each; :meth:`LlamaForCausalLM.load_weights` copies the separate HF
checkpoint tensors into row slices of the merged weights.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from chassis.core import parallel_state
from chassis.core.attention import ForwardContext
from chassis.core.layers.activation import SiluAndMul
from chassis.core.layers.attention import Attention
from chassis.core.layers.norm import RMSNorm
from chassis.core.layers.rotary import RotaryEmbedding, rope_parameters
from chassis.core.layers.vocab_parallel import VocabParallelEmbedding, gather_logits, vocab_shard
from chassis.core.model_interface import CausalLM, LoRASlice, ModelBuildContext
from chassis.core.pipeline_parallel import MissingLayer, stage_layers, tensor_layer

#: checkpoint projection name -> (merged parameter module name, shard key)
_MERGED_SHARDS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
#: projections whose output rows are split over a tensor-parallel group (column parallel)
_COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
#: the column-parallel projections split by KV head (which ranks may share)
_KV_PROJECTIONS = frozenset({"k_proj", "v_proj"})
#: tensors split by vocabulary rows over a tensor-parallel group
_VOCAB_ROWS = frozenset({"model.embed_tokens.weight", "lm_head.weight"})
#: projections whose input columns are split, their outputs summed (row parallel)
_ROW_PARALLEL = frozenset({"o_proj", "down_proj"})
#: HF buffers that some checkpoints contain and that are recomputed here
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class DecoderSpec:
    """Shapes and options of one decoder layer, read from the HF config."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position: int
    rope: dict[str, Any]
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    #: RMSNorm over each head of q and k before RoPE (Qwen3)
    qk_norm: bool = False
    #: the attention window of the sliding layers: each query sees the last
    #: ``sliding_window`` positions, its own included; ``None``: all layers see everything
    sliding_window: int | None = None
    #: the layers that slide (``None``: every layer, when ``sliding_window`` is set)
    sliding_layers: frozenset[int] | None = None
    #: a learned logit per query head (``self_attn.sinks``) joins every softmax denominator
    #: (gpt-oss; needs a backend with ``supports_attention_sinks``)
    attention_sinks: bool = False

    @classmethod
    def from_config(
        cls, cfg: Any, *, activation: str | None = "silu", **overrides: Any
    ) -> DecoderSpec:
        """Read a Llama-style config; ``overrides`` set the per-architecture options.

        ``activation`` is the MLP activation the architecture implements, which the config's
        ``hidden_act`` must name (a ``ValueError`` otherwise); ``None`` skips the check, for
        an architecture that reads and checks its activation itself (Gemma).
        ``sliding_window`` is read as Mistral, Mixtral and Phi-3 define it (every layer, when
        set; see :func:`config_sliding_window`); architectures that slide only some layers
        pass ``sliding_layers`` (:func:`qwen_sliding_layers`).
        """
        act = getattr(cfg, "hidden_act", "silu")
        if activation is not None and act != activation:
            raise ValueError(f"hidden_act {act!r} is not supported (only {activation!r})")
        num_heads = int(cfg.num_attention_heads)
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        fields: dict[str, Any] = {
            "hidden_size": int(cfg.hidden_size),
            "num_heads": num_heads,
            "num_kv_heads": int(getattr(cfg, "num_key_value_heads", None) or num_heads),
            "head_dim": head_dim_of(cfg),
            "intermediate_size": int(cfg.intermediate_size),
            "rms_norm_eps": float(getattr(cfg, "rms_norm_eps", 1e-6)),
            "max_position": int(getattr(cfg, "max_position_embeddings", 2048)),
            "rope": rope_parameters(cfg),
            "qkv_bias": attention_bias,
            "o_bias": attention_bias,
            "mlp_bias": bool(getattr(cfg, "mlp_bias", False)),
            "sliding_window": config_sliding_window(cfg),
        }
        fields.update(overrides)
        return cls(**fields)

    def attention_window(self, layer_idx: int, max_model_len: int | None = None) -> int | None:
        """The sliding window of decoder layer ``layer_idx``, or ``None`` for full attention
        (also when the window is at least ``max_model_len``: no sequence outgrows it)."""
        if self.sliding_layers is not None and layer_idx not in self.sliding_layers:
            return None
        window = self.sliding_window
        if window is not None and max_model_len is not None and window >= max_model_len:
            return None
        return window

    def tensor_parallel_share(self) -> DecoderSpec:
        """This rank's share of the layer: its attention heads and MLP columns (the whole
        layer without tensor parallelism). A ``ValueError`` when the heads or the MLP do not
        split evenly over the group."""
        if parallel_state.tp_size() == 1:
            return self
        _, heads = parallel_state.shard(self.num_heads, "num_attention_heads")
        _, kv_heads = parallel_state.shard_kv_heads(self.num_kv_heads)
        _, inter = parallel_state.shard(self.intermediate_size, "intermediate_size")
        return dataclasses.replace(
            self, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=inter
        )

    def shard_rows(self, merged_rows: int) -> dict[str, tuple[int, int]]:
        """Shard key -> (first row, number of rows) inside a merged weight of
        ``merged_rows`` rows (gate and up are its halves: MLPs of other sizes, such as a MoE
        block's shared expert, use the same keys)."""
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        half = merged_rows // 2
        return {
            "q": (0, q_size),
            "k": (q_size, kv_size),
            "v": (q_size + kv_size, kv_size),
            "gate": (0, half),
            "up": (half, half),
        }


class LlamaAttention(nn.Module):
    """Merged QKV projection, optional q/k norm, RoPE, paged attention, output projection.

    ``scale`` multiplies ``q . k`` (default ``head_dim ** -0.5``); ``sliding_window``,
    ``attention_chunk_size`` (Llama 4) and ``logits_soft_cap`` are this layer's attention
    options (see
    :class:`~chassis.core.layers.attention.Attention`), for the architectures that use them;
    ``input_size`` is the width ``qkv_proj`` reads (default ``hidden_size``; an EAGLE-3
    head's reads twice that).
    With ``spec.attention_sinks`` the layer owns ``sinks`` (``[num_heads]``, this rank's
    heads; the checkpoint's ``self_attn.sinks``), which the backend reads at every call.
    """

    def __init__(
        self,
        spec: DecoderSpec,
        rotary_emb: RotaryEmbedding,
        layer_idx: int,
        build_ctx: ModelBuildContext,
        *,
        scale: float | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        input_size: int | None = None,
        attention_chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(
            input_size or spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        self.sinks: nn.Parameter | None = None
        if spec.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(spec.num_heads), requires_grad=False)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.rotary_emb = rotary_emb  # shared by all layers
        self.attn = Attention(
            spec.num_heads,
            spec.head_dim,
            spec.num_kv_heads,
            spec.head_dim**-0.5 if scale is None else scale,
            layer_idx - build_ctx.first_cache_layer,  # (its KV cache's index)
            build_ctx.attention_backend,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            sinks=self.sinks,
            attention_chunk_size=attention_chunk_size,
        )

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        return self._attend_projected(positions, self.qkv_proj(hidden_states), ctx)

    def forward_after_norm(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        norm: nn.Module,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm(hidden_states, residual)`` (a residual-adding norm), then the attention;
        returns ``(attention output, residual stream)``. A q/k/v projection that can take the
        residual add and the norm itself (the GPU's small-batch GEMV: one launch fewer per
        layer at decode) is asked to; else the two steps. A subclass with a forward of its
        own always gets the two steps."""
        fused = getattr(self.qkv_proj, "forward_add_rms_norm", None)
        if fused is None or type(self).forward is not LlamaAttention.forward:
            hidden_states, residual = norm(hidden_states, residual)
            return self(positions, hidden_states, ctx), residual
        qkv, residual = fused(hidden_states, residual, norm)
        return self._attend_projected(positions, qkv, ctx), residual

    def _attend_projected(
        self, positions: torch.Tensor, qkv: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """The attention after the q/k/v projection (``qkv [T, q + 2 kv]``)."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.encode_positions(positions, q, k)
        # Each rank holds some heads: o_proj's partial sums add up to the whole output.
        return parallel_state.all_reduce(self.o_proj(self.attn(q, k, v, ctx)))

    def encode_positions(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, heads, head_dim]`` and ``k [T, kv_heads, head_dim]`` as attention reads
        them: here the per-head q/k norms (``spec.qk_norm``) and RoPE. An architecture that
        places, skips or scales them otherwise (NoPE layers, interleaved rotation, norms
        after RoPE, position-scaled queries) overrides this, not :meth:`forward`. The inputs
        may be consumed (rotated in place)."""
        qk_norms = (self.q_norm, self.k_norm) if self.qk_norm else None
        return self.rotary_emb(positions, q, k, qk_norms)


class LlamaMLP(nn.Module):
    """SwiGLU MLP with the gate and up projections merged.

    ``intermediate_size`` is this rank's share (``spec.intermediate_size`` by default). With
    ``reduce_output=False`` the output is this rank's partial sum, for a caller that adds more
    partial sums before one all-reduce (a MoE block's shared expert).
    """

    def __init__(
        self, spec: DecoderSpec, intermediate_size: int | None = None, reduce_output: bool = True
    ) -> None:
        super().__init__()
        inter = spec.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * inter, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(inter, spec.hidden_size, bias=spec.mlp_bias)
        self.act_fn = SiluAndMul()
        self.reduce_output = reduce_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._down(self.gate_up_proj(x))

    def forward_after_norm(
        self, hidden_states: torch.Tensor, residual: torch.Tensor, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm(hidden_states, residual)`` (a residual-adding norm), then the MLP; returns
        ``(MLP output, residual stream)``. A gate/up projection that can take the residual
        add and the norm itself (the GPU's small-batch GEMV: one launch fewer per layer at
        decode) is asked to; else the two steps. A subclass with a forward of its own always
        gets the two steps."""
        fused = getattr(self.gate_up_proj, "forward_add_rms_norm", None)
        if fused is None or type(self).forward is not LlamaMLP.forward:
            hidden_states, residual = norm(hidden_states, residual)
            return self(hidden_states), residual
        gate_up, residual = fused(hidden_states, residual, norm)
        return self._down(gate_up), residual

    def _down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The activation and the down projection (summed over ranks unless ``reduce_output``
        is off). A down projection that can apply SwiGLU's activation itself (the GPU's
        small-batch GEMV: one launch fewer per layer at decode) is asked to."""
        fused = getattr(self.down_proj, "forward_silu_and_mul", None)
        if fused is not None and type(self.act_fn) is SiluAndMul:
            out = fused(gate_up)
        else:
            out = self.down_proj(self.act_fn(gate_up))
        # Each rank holds some columns of the MLP: down_proj's partial sums add up.
        return parallel_state.all_reduce(out) if self.reduce_output else out


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; the residual add is fused into the norms.

    ``norm_class`` is both norms' class (an :class:`RMSNorm` that rounds as the
    architecture's checkpoints expect); ``attention_scale`` multiplies ``q . k`` (default
    ``head_dim ** -0.5``); ``self_attn`` replaces the default :class:`LlamaAttention` (then
    ``attention_scale`` is unused). Subclasses that change what follows attention reuse
    :meth:`attend`.
    """

    def __init__(
        self,
        spec: DecoderSpec,
        rotary_emb: RotaryEmbedding,
        layer_idx: int,
        build_ctx: ModelBuildContext,
        mlp: nn.Module,
        *,
        norm_class: type[RMSNorm] = RMSNorm,
        attention_scale: float | None = None,
        self_attn: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if self_attn is None:
            self_attn = LlamaAttention(
                spec,
                rotary_emb,
                layer_idx,
                build_ctx,
                scale=attention_scale,
                sliding_window=spec.attention_window(layer_idx, build_ctx.max_model_len),
            )
        #: ``(positions, [T, hidden], ctx) -> [T, hidden]``, summed over a tensor-parallel group
        self.self_attn = self_attn
        #: ``[T, hidden] -> [T, hidden]``, already summed over a tensor-parallel group
        self.mlp = mlp
        self.input_layernorm = norm_class(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = norm_class(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(mlp output, residual stream)``; their sum is the layer's output."""
        hidden_states, residual = self.attend(positions, hidden_states, residual, ctx)
        # (a LlamaMLP may take the norm into its first projection's launch)
        after_norm = getattr(self.mlp, "forward_after_norm", None)
        if after_norm is not None:
            return after_norm(hidden_states, residual, self.post_attention_layernorm)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual

    def attend(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's first half: ``(attention output, residual stream)`` after the input
        norm (with the previous layer's residual add fused in; ``residual`` is ``None`` for
        the first layer)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            return self.self_attn(positions, hidden_states, ctx), residual
        # (a LlamaAttention may take the norm into its q/k/v projection's launch)
        after_norm = getattr(self.self_attn, "forward_after_norm", None)
        if after_norm is not None:
            return after_norm(positions, hidden_states, residual, self.input_layernorm, ctx)
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
        return self.self_attn(positions, hidden_states, ctx), residual


#: builds decoder layer ``layer_idx`` around the rotary table all layers share
MakeLayer = Callable[[int, RotaryEmbedding, ModelBuildContext], nn.Module]


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.*`` submodule).

    ``make_layer(layer_idx, rotary_emb, build_ctx)`` builds each decoder layer
    (:meth:`LlamaForCausalLM.make_layer`), which :meth:`forward` calls as a
    :class:`LlamaDecoderLayer`: ``layer(positions, hidden_states, residual, ctx)`` returns
    ``(block output, residual stream)``, ``residual`` being ``None`` for the first layer.
    ``norm_class`` is the final norm's class; ``embedding_multiplier`` (Granite, Gemma) scales
    the token embeddings. ``rope_per_layer`` gives each layer's RoPE parameters when they
    differ by layer (Gemma 3's local and global layers); by default every layer uses
    ``spec.rope``. Layers with equal parameters share one rotary table, of ``rotary_class``
    (M-RoPE's :class:`~chassis.core.layers.mrope.MRotaryEmbedding` for Qwen2-VL).

    Pipeline parallel (``--pipeline-parallel-size``): this stage builds only its layers
    ``[start_layer, end_layer)`` (:func:`~chassis.core.pipeline_parallel.stage_layers`; the
    others are parameterless :class:`~chassis.core.pipeline_parallel.MissingLayer`), the
    embedding only on the first stage and the final norm only on the last (``None``
    elsewhere). Its attention layers read KV caches ``0 .. end_layer - start_layer - 1``: a
    stage's KV cache holds its own layers only, so ``make_layer`` gets a ``build_ctx`` whose
    ``first_cache_layer`` is ``start_layer``.
    """

    def __init__(
        self,
        hf_config: Any,
        spec: DecoderSpec,
        build_ctx: ModelBuildContext,
        make_layer: MakeLayer,
        *,
        norm_class: type[RMSNorm] = RMSNorm,
        embedding_multiplier: float | None = None,
        rope_per_layer: Sequence[dict[str, Any]] | None = None,
        rotary_class: type[RotaryEmbedding] = RotaryEmbedding,
    ) -> None:
        super().__init__()
        num_layers = int(hf_config.num_hidden_layers)
        stage, stages = parallel_state.pp_rank(), parallel_state.pp_size()
        self.start_layer, self.end_layer = (
            stage_layers(num_layers, stage, stages) if stages > 1 else (0, num_layers)
        )
        self.first_stage, self.last_stage = stage == 0, stage == stages - 1
        self.hidden_size = spec.hidden_size
        self.embed_tokens: VocabParallelEmbedding | None = (
            VocabParallelEmbedding(int(hf_config.vocab_size), spec.hidden_size)
            if self.first_stage
            else None
        )
        self.embedding_multiplier = embedding_multiplier
        if rope_per_layer is None:
            rope_per_layer = [spec.rope] * num_layers
        elif len(rope_per_layer) != num_layers:
            raise ValueError(
                f"rope_per_layer has {len(rope_per_layer)} entries for {num_layers} layers"
            )
        # this stage's KV caches are its layers' only: cache 0 is layer start_layer's
        stage_ctx = dataclasses.replace(build_ctx, first_cache_layer=self.start_layer)
        rotaries: list[tuple[dict[str, Any], RotaryEmbedding]] = []
        layers = []
        for i, params in enumerate(rope_per_layer):
            rotary_emb = next((table for p, table in rotaries if p == params), None)
            if rotary_emb is None:
                rotary_emb = rotary_class(
                    spec.head_dim, spec.max_position, params, context_len=build_ctx.max_model_len
                )
                rotaries.append((params, rotary_emb))
            if self.start_layer <= i < self.end_layer:
                layers.append(make_layer(i, rotary_emb, stage_ctx))
            else:
                layers.append(MissingLayer())
        self.layers = nn.ModuleList(layers)
        self.norm = norm_class(spec.hidden_size, spec.rms_norm_eps) if self.last_stage else None
        #: the layers whose input :meth:`forward` keeps in :attr:`aux_hidden_states` (an
        #: EAGLE-3 head reads them; ``CausalLM.set_aux_hidden_state_layers``); empty: none
        self.aux_layer_ids: frozenset[int] = frozenset()
        self._aux_order: tuple[int, ...] = ()  # the ids as the head reads them
        self.aux_hidden_states: list[torch.Tensor] = []

    #: whether :meth:`forward` keeps :attr:`aux_layer_ids`' inputs (a subclass with a
    #: forward of its own that does not sets False)
    keeps_aux_hidden_states = True

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[n]`` token ids -> ``[n, hidden_size]``: what the first layer reads."""
        if self.embed_tokens is None:
            raise RuntimeError("the token embeddings are on the first pipeline stage")
        hidden_states = self.embed_tokens(input_ids)
        if self.embedding_multiplier is not None:
            # in the model dtype, as HF multiplies (the embedding is whole on every rank here)
            hidden_states = hidden_states * self.embedding_multiplier
        return hidden_states

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states; ``inputs_embeds`` (:meth:`embed`'s output, some rows
        replaced) stands in for ``embed(input_ids)`` when given.

        Pipeline parallel: the first stage embeds, the others take the hidden states and
        residual stream from the previous stage; each runs its layers, then the last
        normalizes and the others send both on to the next stage and return their layers'
        output, which only gives the shape (the logits come from the last stage). Every
        stage runs the same steps in the same order, so each send meets its receive; without
        stages the one stage is both first and last."""
        residual: torch.Tensor | None = None
        if self.first_stage:
            hidden_states = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        else:
            hidden_states, residual = self._receive_from_previous_stage(positions)
        layers = itertools.islice(self.layers, self.start_layer, self.end_layer)
        aux = self.aux_layer_ids
        if aux:  # off (the plain path): no test per layer
            kept = {}
            for i, layer in enumerate(layers, self.start_layer):
                if i in aux:  # the residual stream entering layer i (HF's hidden_states[i])
                    kept[i] = hidden_states if residual is None else hidden_states + residual
                hidden_states, residual = layer(positions, hidden_states, residual, ctx)
            self.aux_hidden_states = [kept[i] for i in self._aux_order]
        else:
            for layer in layers:
                hidden_states, residual = layer(positions, hidden_states, residual, ctx)
        if not self.last_stage:
            assert residual is not None  # (every stage holds at least one layer)
            parallel_state.send_to_next_stage(torch.stack((hidden_states, residual)))
            return hidden_states
        assert self.norm is not None
        if residual is None:  # a model with no layers
            return self.norm(hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def _receive_from_previous_stage(
        self, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A stage but the first: the previous stage's hidden states and residual stream,
        ``[num_tokens, hidden_size]`` each, in this stage's dtype and device."""
        weight = next(self.layers[self.start_layer].parameters())
        num_tokens = positions.shape[-1]
        both = parallel_state.recv_from_previous_stage(
            (2, num_tokens, self.hidden_size), weight.dtype, weight.device
        )
        return both[0], both[1]


class LlamaForCausalLM(CausalLM):
    """``LlamaForCausalLM`` / ``MistralForCausalLM`` checkpoints.

    Subclasses change the architecture options by overriding :meth:`decoder_spec`, the MLP of
    some layers with :meth:`make_mlp`, the norms with :attr:`norm_class`, the decoder layers
    with :meth:`make_layer`, or the whole decoder with :meth:`build_decoder`.

    Tensor parallel: every rank keeps ``1/N`` of the attention heads and of the MLP columns,
    ``1/N`` of the KV heads or, with fewer KV heads than ranks, one replicated KV head (the
    one its query heads read), and ``1/N`` of the vocabulary rows of the embedding and the
    LM head (``core/layers/vocab_parallel.py``). It sums the partial outputs of ``o_proj``,
    ``down_proj`` and the embedding over the group and gathers the logits; the norms are
    whole on every rank.

    Pipeline parallel: each stage holds its run of the decoder layers (:class:`LlamaModel`),
    the last also the LM head (a tied head: the embedding matrix, loaded there too); the
    last stage's logits are broadcast to every stage, so the runner samples on each as it
    does without stages. A subclass supports it only when it declares
    ``supports_pipeline_parallel`` itself (it may change the decoder's layout).
    """

    supports_tensor_parallel = True
    supports_pipeline_parallel = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Unlike supports_tensor_parallel, the opt-in is not inherited: most of the ~70
        # subclasses replace the decoder, its layers' attention, the head or the weight
        # loading, which stages would split wrongly, and an inherited True would claim
        # support for each (and for every new subclass) untested. So a subclass that keeps
        # this class's stage layout declares `supports_pipeline_parallel = True` in its own
        # body (Qwen2's, Qwen3's); any other reads False here.
        if "supports_pipeline_parallel" not in cls.__dict__:
            cls.supports_pipeline_parallel = False

    #: the class of every norm (each layer's and the final one) that :meth:`build_decoder`
    #: and :meth:`make_layer` build
    norm_class: type[RMSNorm] = RMSNorm

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        super().__init__(hf_config, build_ctx)
        #: the whole layer's shapes (checkpoint tensors), and this rank's share of them
        self.full_spec = self.decoder_spec(hf_config)
        self.spec = self.full_spec.tensor_parallel_share()
        self.model = self.build_decoder(hf_config, build_ctx)
        self.vocab_size = int(hf_config.vocab_size)
        self.build_head(hf_config)

    def build_head(self, hf_config: Any) -> None:
        """Build the head over the final hidden states: ``lm_head`` (a subclass with another
        head, such as a sequence classifier's ``score``, overrides this) and set
        ``tie_word_embeddings``. Called from ``__init__`` after :meth:`build_decoder`."""
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if parallel_state.pp_size() > 1:
            self._build_stage_head()
            return
        # The head is a module even when tied (then sharing the embedding matrix, built on the
        # meta device so no second matrix is allocated; parameter listings name it once, as
        # model.embed_tokens.weight) so that a platform's prepare_model can swap it too.
        head_device = "meta" if self.tie_word_embeddings else None
        # this rank's vocabulary rows (all of them without tensor parallelism)
        _, vocab_rows = vocab_shard(self.vocab_size)
        self.lm_head = nn.Linear(self.spec.hidden_size, vocab_rows, bias=False, device=head_device)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _build_stage_head(self) -> None:
        """Pipeline parallel: the LM head on the last stage only (``None`` elsewhere); tied,
        it shares the embedding when that stage also holds it (one stage), else it is a
        matrix of its own, loaded from the checkpoint's embedding (:meth:`load_weights`)."""
        if not self.model.last_stage:
            self.lm_head = None
            return
        tied_here = self.tie_word_embeddings and self.model.embed_tokens is not None
        self.lm_head = nn.Linear(
            self.spec.hidden_size,
            self.vocab_size,
            bias=False,
            device="meta" if tied_here else None,
        )
        if tied_here:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_attention_layers(self) -> int:
        """This pipeline stage's decoder layers (all of them without stages)."""
        if parallel_state.pp_size() == 1:
            return super().num_attention_layers
        return self.model.end_layer - self.model.start_layer

    def needs_checkpoint_tensor(self, name: str) -> bool:
        """Pipeline parallel: only this stage's tensors (its layers; the embedding on the
        first stage, and on the last when the head is tied to it; the final norm and LM head
        on the last), so that the others are never read."""
        if parallel_state.pp_size() == 1:
            return super().needs_checkpoint_tensor(name)
        decoder = self.model
        layer = tensor_layer(name)
        if layer is not None:
            return decoder.start_layer <= layer < decoder.end_layer
        if name.startswith("model.embed_tokens."):
            return decoder.first_stage or (decoder.last_stage and self.tie_word_embeddings)
        if name.startswith(("model.norm.", "lm_head.")):
            return decoder.last_stage
        return True  # (anything else: load_weights says whether it belongs)

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        """The decoder-layer options for this architecture (override in subclasses).

        HF's Llama has no sliding window: a ``sliding_window`` in a ``llama`` config is
        ignored, as transformers ignores it; Mistral configs (``model_type`` ``mistral``,
        served by this class too) keep theirs."""
        if getattr(hf_config, "model_type", None) == "llama":
            return DecoderSpec.from_config(hf_config, sliding_window=None)
        return DecoderSpec.from_config(hf_config)

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> nn.Module:
        """HF's ``model.*`` submodule (a :class:`LlamaModel` of :meth:`make_layer`'s layers by
        default; override for another layout): ``forward(input_ids, positions, ctx)`` returns
        the final hidden states, its parameters carry the checkpoint's names, and its
        ``embed_tokens`` is a :class:`VocabParallelEmbedding` (a tied LM head shares its
        weight). Called from ``__init__`` after ``self.spec`` and ``self.full_spec`` are
        set."""
        return LlamaModel(
            hf_config, self.spec, build_ctx, self.make_layer, norm_class=self.norm_class
        )

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> nn.Module:
        """Decoder layer ``layer_idx`` of :meth:`build_decoder`'s :class:`LlamaModel`, which
        calls it as a :class:`LlamaDecoderLayer` (by default one of :attr:`norm_class` around
        :meth:`make_mlp`'s MLP; override for another layer). Called from ``__init__`` after
        ``self.spec`` and ``self.full_spec`` are set."""
        return LlamaDecoderLayer(
            self.spec,
            rotary_emb,
            layer_idx,
            build_ctx,
            self.make_mlp(layer_idx),
            norm_class=self.norm_class,
        )

    def make_mlp(self, layer_idx: int) -> nn.Module:
        """The MLP of decoder layer ``layer_idx`` (override for sparse layers); it returns
        its output summed over the tensor-parallel group. Called from ``__init__`` after
        ``self.spec`` (this rank's share) and ``self.full_spec`` are set."""
        return LlamaMLP(self.spec)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if inputs_embeds is None:  # (a subclass's decoder may take no inputs_embeds)
            return self.model(input_ids, positions, ctx)
        return self.model(input_ids, positions, ctx, inputs_embeds=inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The decoder's token embeddings of ``input_ids`` (prompts given as embeddings:
        core/prompt_embeds_runner.py); a decoder without ``embed`` cannot give them."""
        embed = getattr(self.model, "embed", None)
        if embed is None:
            raise NotImplementedError(f"{type(self.model).__name__} has no embed(input_ids)")
        return embed(input_ids)

    def set_aux_hidden_state_layers(self, layer_ids: tuple[int, ...]) -> None:
        """As :meth:`CausalLM.set_aux_hidden_state_layers`: kept by :class:`LlamaModel`'s
        forward (a decoder of another forward refuses)."""
        decoder = self.model
        if not (isinstance(decoder, LlamaModel) and decoder.keeps_aux_hidden_states):
            super().set_aux_hidden_state_layers(layer_ids)
        num_layers = len(decoder.layers)
        bad = [i for i in layer_ids if not 0 <= int(i) < num_layers]
        if bad:
            raise ValueError(
                f"auxiliary hidden state layer ids {bad} are outside the target's layers "
                f"0 .. {num_layers - 1}"
            )
        decoder._aux_order = tuple(int(i) for i in layer_ids)
        decoder.aux_layer_ids = frozenset(decoder._aux_order)
        decoder.aux_hidden_states = []

    def aux_hidden_state_layers(self) -> tuple[int, ...]:
        """As :meth:`CausalLM.aux_hidden_state_layers`."""
        decoder = self.model
        return decoder._aux_order if isinstance(decoder, LlamaModel) else ()

    def put_aux_hidden_states(self, states: list[torch.Tensor]) -> None:
        """As :meth:`CausalLM.put_aux_hidden_states`."""
        self.model.aux_hidden_states = list(states)

    def take_aux_hidden_states(self) -> list[torch.Tensor]:
        """As :meth:`CausalLM.take_aux_hidden_states`."""
        states, self.model.aux_hidden_states = self.model.aux_hidden_states, []
        return states

    #: checkpoint projection -> the merged module it loads into (what :meth:`load_weights`
    #: does with it, :data:`_MERGED_SHARDS`)
    merged_projections: Mapping[str, str] = {
        name: module for name, (module, _) in _MERGED_SHARDS.items()
    }
    #: merged module -> the checkpoint projections it holds, in row order (LoRA adapters
    #: name those); a subclass whose checkpoint keeps them merged (Phi-3) empties it
    lora_merged_projections: dict[str, tuple[str, ...]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    def lora_slices(self, module_name: str, module: nn.Module) -> list[LoRASlice]:
        """A merged Q/K/V or gate/up layer holds one slice per checkpoint projection (rows
        as :meth:`load_weights` fills them); whole shapes undo the tensor-parallel cut."""
        if not super().lora_slices(module_name, module):
            return []
        prefix, _, leaf = module_name.rpartition(".")
        projections = self.lora_merged_projections.get(leaf) or (leaf,)
        rows = self.spec.shard_rows(int(module.out_features))
        tp = parallel_state.tp_size()
        slices = []
        for name in projections:
            merged = _MERGED_SHARDS.get(name)
            first, size = rows[merged[1]] if merged else (0, int(module.out_features))
            # the whole projection, from this rank's share and how it is cut
            in_full, out_full = int(module.in_features), size
            if name in _KV_PROJECTIONS:
                out_full = self.full_spec.num_kv_heads * self.full_spec.head_dim
            elif name in _COLUMN_PARALLEL:
                out_full = size * tp
            elif name in _ROW_PARALLEL:
                in_full *= tp
            slices.append(LoRASlice(f"{prefix}.{name}", first, size, in_full, out_full))
        return slices

    def lora_shard(
        self, hf_module: str, lora_a: torch.Tensor, lora_b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As the projection's weight is cut (:meth:`_tensor_parallel_slice`): B's rows for
        q/k/v/gate/up, A's columns for o/down."""
        leaf = hf_module.rpartition(".")[2]
        weight_name = f"{hf_module}.weight"
        if leaf in _COLUMN_PARALLEL:
            return lora_a, self._tensor_parallel_slice(weight_name, lora_b)
        if leaf in _ROW_PARALLEL:
            return self._tensor_parallel_slice(weight_name, lora_a), lora_b
        return lora_a, lora_b

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Project to the vocabulary in the model dtype; return float32 ``[n, vocab]`` (under
        tensor parallelism each rank projects to its vocabulary rows and the logits are
        gathered; under pipeline parallelism the last stage's are broadcast to every stage,
        the others passing rows of the right count only)."""
        if parallel_state.pp_size() > 1:
            if self.lm_head is None:
                logits = hidden_states.new_empty(
                    (hidden_states.shape[0], self.vocab_size), dtype=torch.float32
                )
            else:
                logits = self.lm_head(hidden_states).float()
            return parallel_state.broadcast_from_last_stage(logits)
        logits = self.lm_head(hidden_states)
        if parallel_state.tp_size() > 1:
            logits = gather_logits(logits, self.vocab_size)
        return logits.float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors in; return the names of the parameters now fully filled.

        ``q_proj``/``k_proj``/``v_proj`` go to row slices of ``qkv_proj`` and
        ``gate_proj``/``up_proj`` to ``gate_up_proj``; a merged parameter counts as filled
        once all of its shards arrived. ``rotary_emb.inv_freq`` buffers are skipped, and so is
        ``lm_head.weight`` when the embeddings are tied. Any other unknown name, or a shape
        that does not match, raises ``ValueError``.
        """
        params = dict(self.named_parameters())
        shards_loaded: dict[str, set[str]] = {}
        for name, tensor in weights:
            tensor = self._tensor_parallel_slice(name, tensor)
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            if name == "model.embed_tokens.weight" and self._head_loads_embedding():
                name = "lm_head.weight"  # a tied head on a stage without the embedding
            copy_checkpoint_tensor(
                params,
                self.spec,
                name,
                tensor,
                shards_loaded,
                unknown=f"checkpoint tensor {name!r} has no counterpart in "
                f"{type(self).__name__}; is the checkpoint's architecture right?",
                label=f"checkpoint tensor {name!r}",
            )
        return filled_parameters(shards_loaded)

    def _head_loads_embedding(self) -> bool:
        """Whether this pipeline stage's tied LM head is a matrix of its own (the embedding
        is on another stage), filled from the checkpoint's embedding."""
        return (
            parallel_state.pp_size() > 1
            and self.tie_word_embeddings
            and self.lm_head is not None
            and self.model.embed_tokens is None
        )

    def _tensor_parallel_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole checkpoint tensor: rows of the column-parallel
        projections (q, k, v, gate, up: weights and biases), columns of the row-parallel ones
        (o, down), whose biases only rank 0 adds, and the attention sinks of this rank's query
        heads. Other tensors are whole."""
        if parallel_state.tp_size() == 1:
            return tensor
        if name.endswith(".self_attn.sinks"):
            start, count = parallel_state.shard(tensor.shape[0], "num_attention_heads")
            return tensor[start : start + count]
        leaf = name.split(".")[-2] if "." in name else ""
        if name in _VOCAB_ROWS:
            if tensor.shape[0] != self.vocab_size:  # as the unsplit shapes would refuse it
                raise ValueError(
                    f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, expected the "
                    f"vocabulary's {self.vocab_size} (does config.json match the weights?)"
                )
            # this rank's vocabulary rows, padded with zero rows past the vocabulary
            start, rows = vocab_shard(self.vocab_size)
            part = tensor[start : start + rows]
            if part.shape[0] < rows:
                part = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
            return part
        if leaf in _KV_PROJECTIONS:
            # by KV head: an even share, or one replicated head when there are fewer than ranks
            first, count = parallel_state.shard_kv_heads(self.full_spec.num_kv_heads)
            head_dim = self.full_spec.head_dim
            return tensor[first * head_dim : (first + count) * head_dim]
        if leaf in _COLUMN_PARALLEL:
            start, length = parallel_state.shard(tensor.shape[0], name)
            return tensor[start : start + length]
        if leaf in _ROW_PARALLEL:
            if name.endswith(".bias"):
                return tensor if parallel_state.tp_rank() == 0 else torch.zeros_like(tensor)
            start, length = parallel_state.shard(tensor.shape[1], name)
            return tensor[:, start : start + length]
        return tensor


class LlamaForSequenceClassification(LlamaForCausalLM):
    """``LlamaForSequenceClassification`` checkpoints (and, as a base listed first, the
    Qwen2/Qwen3 ones): the decoder with HF's ``score`` head, a bias-free linear layer from the
    hidden size to ``num_labels``, instead of the LM head.

    :meth:`forward` returns every token's class logits ``[num_tokens, num_labels]`` (HF
    projects every token too, then picks the last non-padding one); a pooling engine
    (``runner="pooling"``, which vLLM's ``auto`` and chassis pick for these checkpoints) pools
    them into each prompt's logits (:mod:`chassis.core.pooling_classify`). The head is whole
    on every tensor-parallel rank (the hidden states are).
    """

    is_sequence_classifier = True

    def build_head(self, hf_config: Any) -> None:
        # no LM head: an lm_head.weight in the checkpoint is an error, not skipped
        self.tie_word_embeddings = False
        self.num_labels = int(hf_config.num_labels)
        self.score = nn.Linear(self.spec.hidden_size, self.num_labels, bias=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        return self.score(self.model(input_ids, positions, ctx))

    def lora_slices(self, module_name: str, module: nn.Module) -> list[LoRASlice]:
        """The decoder's projections, not the ``score`` head: PEFT trains a classifier's
        head as a whole module (``modules_to_save``), never as a LoRA pair, and adapters
        with ``modules_to_save`` are refused (docs/lora.md)."""
        if module_name == "score":
            return []
        return super().lora_slices(module_name, module)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The class logits of :meth:`forward`'s rows as float32 (forward already applied
        the head; a pooling engine never samples, this serves its memory profile)."""
        return hidden_states.float()


def _merged_target(name: str) -> tuple[str, str | None]:
    """Checkpoint name -> (our parameter name, shard key or None when not merged)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        merged = _MERGED_SHARDS.get(part)
        if merged is not None:
            module, shard = merged
            return ".".join([*parts[:i], module, *parts[i + 1 :]]), shard
    return name, None


def copy_checkpoint_tensor(
    params: dict[str, nn.Parameter],
    spec: DecoderSpec,
    name: str,
    tensor: torch.Tensor,
    shards_loaded: dict[str, set[str]],
    *,
    unknown: str,
    label: str = "checkpoint tensor",
    hint: str = "does config.json match the weights?",
) -> None:
    """Copy checkpoint tensor ``name`` (module-relative: ``q_proj`` / ``gate_proj`` and the
    like go to their rows of a merged parameter, split by ``spec``) into its parameter of
    ``params`` and note the shard in ``shards_loaded`` (for :func:`filled_parameters`).
    ``ValueError(unknown)`` when no parameter takes it; a shape that does not match is a
    ``ValueError`` ``"{label} has shape ..., expected ... ({hint})"``."""
    param_name, shard = _merged_target(name)
    param = params.get(param_name)
    if param is None:
        raise ValueError(unknown)
    target = param.data
    if shard is not None:
        start, size = spec.shard_rows(target.shape[0])[shard]
        target = target[start : start + size]
    if target.shape != tensor.shape:
        raise ValueError(
            f"{label} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)} ({hint})"
        )
    target.copy_(tensor)
    shards_loaded.setdefault(param_name, set()).add(shard or "")


def filled_parameters(shards_loaded: dict[str, set[str]]) -> set[str]:
    """The parameters of ``shards_loaded`` whose every shard arrived."""
    return {name for name, shards in shards_loaded.items() if shards >= _shards_needed(name)}


def _shards_needed(param_name: str) -> set[str]:
    parts = param_name.split(".")
    if "qkv_proj" in parts:
        return {"q", "k", "v"}
    if "gate_up_proj" in parts:
        return {"gate", "up"}
    return {""}


def head_dim_of(hf_config: Any) -> int:
    """``config.head_dim``, or ``hidden_size / num_attention_heads`` when it is absent."""
    return int(
        getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads
    )


def config_sliding_window(cfg: Any) -> int | None:
    """The config's attention window, or ``None`` when no layer slides.

    ``None`` when ``sliding_window`` is missing, null or 0, when the config switches it off
    with ``use_sliding_window: false`` (Qwen; transformers 5 already nulls it then, 4.x
    configs did not), and when the window is at least ``max_position_embeddings``: no
    position can then see past it, so full attention is the same and needs no backend
    support for windows.
    """
    window = getattr(cfg, "sliding_window", None)
    if not window or getattr(cfg, "use_sliding_window", None) is False:
        return None
    window = int(window)
    max_position = getattr(cfg, "max_position_embeddings", None)
    if isinstance(max_position, int) and window >= max_position:
        return None
    return window


def qwen_sliding_layers(cfg: Any, is_sliding: Callable[[int], bool]) -> frozenset[int]:
    """The layers that slide in a Qwen-style config (for ``DecoderSpec.sliding_layers``).

    ``layer_types`` decides when the config has it (``"sliding_attention"`` entries;
    transformers 5 fills it in from ``max_window_layers``), else ``is_sliding(layer_idx)``,
    the architecture's rule for configs without it. Whether any layer slides at all is
    :func:`config_sliding_window`'s answer (``use_sliding_window``).
    """
    num_layers = int(cfg.num_hidden_layers)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        if len(layer_types) != num_layers:
            raise ValueError(
                f"config layer_types has {len(layer_types)} entries for {num_layers} layers "
                "(num_hidden_layers); fix config.json"
            )
        return frozenset(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    return frozenset(i for i in range(num_layers) if is_sliding(i))
