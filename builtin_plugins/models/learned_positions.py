"""Decoders with a learned absolute position table instead of RoPE (OPT, GPT-2).

What OPT and GPT-2 share, as HF transformers' ``modeling_opt.py`` and ``modeling_gpt2.py``
define them::

    h = embed_tokens(ids) (-> project_in) + embed_positions(position + offset)
    per layer, pre-norm:  h = h + attn(ln1(h));  h = h + mlp(ln2(h))
    per layer, post-norm: h = ln1(h + attn(h));  h = ln2(h + mlp(h))   (OPT-350m)
    final norm (pre-norm models) (-> project_out), tied LM head

Attention is Llama's (one merged ``qkv_proj``, paged attention, ``o_proj``) without
RoPE; the MLP is StarCoder2's non-gated ``c_fc`` -> activation -> ``c_proj`` with the
activation the config names. The position ids the runner passes (0-based, one per token)
index the table, shifted by ``offset`` rows (OPT keeps 2 unused rows first). Tensor
parallelism, LoRA cuts and weight loading by internal (Llama-style) names are
:class:`Starcoder2ForCausalLM`'s; each architecture renames its checkpoint's tensors to
those names (:class:`LearnedPositionsForCausalLM`, a
:class:`~chassis.builtin_plugins.models.parallel_residual.CheckpointRenames`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaAttention
from chassis.builtin_plugins.models.parallel_residual import GELU_ACTIVATIONS, CheckpointRenames
from chassis.builtin_plugins.models.starcoder2 import LayerNorm, Starcoder2ForCausalLM
from chassis.core import parallel_state
from chassis.core.attention import ForwardContext
from chassis.core.layers.vocab_parallel import VocabParallelEmbedding, vocab_shard
from chassis.core.model_interface import ModelBuildContext

#: HF ``activation_function`` names -> the activation (elementwise, in the input dtype): ReLU
#: (OPT) and the GELUs of :data:`.parallel_residual.GELU_ACTIVATIONS` (one table of what each
#: GELU name means)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    **{
        name: functools.partial(F.gelu, approximate=approximate)
        for name, approximate in GELU_ACTIVATIONS.items()
    },
}


def activation_of(hf_config: Any, arch: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP activation the config's ``activation_function`` names; a ``ValueError``
    naming it and the supported ones otherwise."""
    name = getattr(hf_config, "activation_function", None)
    if name not in ACTIVATIONS:
        raise ValueError(
            f"{arch} activation_function {name!r} is not supported; supported: "
            f"{', '.join(ACTIVATIONS)}"
        )
    return ACTIVATIONS[name]


class PositionlessAttention(LlamaAttention):
    """:class:`LlamaAttention` with no rotary encoding: positions enter through the
    embedding table, q and k go to attention as projected."""

    def encode_positions(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


class PlainMLP(nn.Module):
    """``c_proj(act(c_fc(x)))`` with optional biases, summed over the tensor-parallel group
    (``c_fc`` holds this rank's rows, ``c_proj`` the matching columns)."""

    def __init__(self, spec: DecoderSpec, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.c_fc = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)
        self.c_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return parallel_state.all_reduce(self.c_proj(self.act(self.c_fc(x))))


class LearnedPositionsLayer(nn.Module):
    """One decoder layer: attention and MLP blocks, each with a residual add and a
    LayerNorm before the block (``pre_norm``) or after the add (OPT's
    ``do_layer_norm_before=False``). ``forward(positions, h, ctx) -> h``."""

    def __init__(
        self,
        spec: DecoderSpec,
        layer_idx: int,
        build_ctx: ModelBuildContext,
        mlp: nn.Module,
        *,
        pre_norm: bool,
        attention_scale: float | None = None,
    ) -> None:
        super().__init__()
        no_rotary: Any = None  # PositionlessAttention never reads a rotary table
        self.self_attn = PositionlessAttention(
            spec, no_rotary, layer_idx, build_ctx, scale=attention_scale
        )
        self.mlp = mlp
        self.input_layernorm = LayerNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = LayerNorm(spec.hidden_size, spec.rms_norm_eps)
        self.pre_norm = pre_norm

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        h = hidden_states
        if self.pre_norm:
            h = h + self.self_attn(positions, self.input_layernorm(h), ctx)
            return h + self.mlp(self.post_attention_layernorm(h))
        h = self.input_layernorm(h + self.self_attn(positions, h, ctx))
        return self.post_attention_layernorm(h + self.mlp(h))


class LearnedPositionsDecoder(nn.Module):
    """Token and position embeddings, the layers, the final norm (internal ``model.*``).

    ``embed_dim`` is the token embedding's width (OPT's ``word_embed_proj_dim``); when it
    differs from ``spec.hidden_size``, bias-free ``project_in``/``project_out`` map between
    them. ``num_positions`` rows of ``embed_positions`` (whole on every rank); position
    ``p`` reads row ``p + position_offset``. ``final_norm=False``: no final norm (OPT's
    post-norm checkpoints).
    """

    def __init__(
        self,
        hf_config: Any,
        spec: DecoderSpec,
        layers: list[nn.Module],
        *,
        embed_dim: int,
        num_positions: int,
        position_offset: int = 0,
        final_norm: bool = True,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(int(hf_config.vocab_size), embed_dim)
        self.embed_positions = nn.Embedding(num_positions, spec.hidden_size)
        self.position_offset = position_offset
        projected = embed_dim != spec.hidden_size
        self.project_in = nn.Linear(embed_dim, spec.hidden_size, bias=False) if projected else None
        self.project_out = nn.Linear(spec.hidden_size, embed_dim, bias=False) if projected else None
        self.layers = nn.ModuleList(layers)
        self.norm = LayerNorm(spec.hidden_size, spec.rms_norm_eps) if final_norm else None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """``[T]`` token ids and their 0-based positions -> ``[T, embed_dim]`` final hidden
        states (what the LM head reads)."""
        h = self.embed_tokens(input_ids)
        if self.project_in is not None:
            h = self.project_in(h)
        h = h + self.embed_positions(positions + self.position_offset)
        for layer in self.layers:
            h = layer(positions, h, ctx)
        if self.norm is not None:
            h = self.norm(h)
        if self.project_out is not None:
            h = self.project_out(h)
        return h


class LearnedPositionsForCausalLM(CheckpointRenames, Starcoder2ForCausalLM):
    """Base of :class:`~chassis.builtin_plugins.models.opt.OPTForCausalLM` and
    :class:`~chassis.builtin_plugins.models.gpt2.GPT2LMHeadModel`.

    A subclass gives :meth:`decoder_spec`, :meth:`build_decoder` (a
    :class:`LearnedPositionsDecoder`) and the checkpoint's names as
    :class:`~chassis.builtin_plugins.models.parallel_residual.CheckpointRenames` takes them
    to the internal ones (``model.layers.{i}.self_attn.q_proj``, ``o_proj``, ``mlp.c_fc``,
    ``input_layernorm``, ``model.embed_tokens``, ...): :attr:`checkpoint_renames` pairs
    (OPT) or a :meth:`checkpoint_tensors` that renames, transposes and splits (GPT-2).
    Tensor parallel: Llama's cuts (heads, ``c_fc`` rows, ``c_proj`` columns, vocabulary
    rows); the position table, norms and projections are whole.
    """

    prompt_embeds_refusal = "its decoder (LearnedPositionsDecoder) takes no inputs_embeds"

    #: the checkpoint's model name, for error messages
    arch_name = "model"

    def build_head(self, hf_config: Any) -> None:
        """Llama's head, over the decoder's output width (the token embedding's: OPT's
        ``word_embed_proj_dim``), tied unless ``tie_word_embeddings`` is false."""
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        width = int(self.model.embed_tokens.weight.shape[1])
        _, vocab_rows = vocab_shard(self.vocab_size)  # this rank's rows
        # as Llama's: a tied head is a module on the meta device sharing the embedding
        device = "meta" if self.tie_word_embeddings else None
        self.lm_head = nn.Linear(width, vocab_rows, bias=False, device=device)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def unknown(self, name: str) -> ValueError:
        """The error for a checkpoint tensor with no counterpart."""
        return ValueError(
            f"checkpoint tensor {name!r} has no counterpart in {self.arch_name}; is the "
            "checkpoint's architecture right?"
        )


def check_max_len(build_ctx: ModelBuildContext, max_position: int, arch: str) -> None:
    """A ``ValueError`` when the engine's ``max_model_len`` exceeds the position table (no
    row for the later positions)."""
    max_len = build_ctx.max_model_len
    if max_len is not None and max_len > max_position:
        raise ValueError(
            f"max_model_len {max_len} exceeds {arch}'s {max_position} learned positions "
            "(max_position_embeddings); use --max-model-len <= that"
        )
