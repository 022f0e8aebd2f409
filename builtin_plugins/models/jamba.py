"""AI21 Jamba (``JambaForCausalLM``: ai21labs/Jamba-v0.1, AI21-Jamba-Mini/Large-1.5/1.6/1.7):
Mamba-1 layers with attention every ``attn_layer_period`` layers and a sparse MoE block every
``expert_layer_period`` layers.

As HF transformers' ``Jamba`` code defines it:

- layer ``i`` mixes with attention when ``i % attn_layer_period == attn_layer_offset``
  (Llama's GQA attention without any position encoding, scaled by ``head_dim ** -0.5``),
  otherwise with a :class:`~chassis.core.layers.mamba_mixer.MambaMixer` whose ``dt``, ``B``
  and ``C`` pass through weighted RMS norms (``dt_layernorm``, ``b_layernorm``,
  ``c_layernorm``; eps ``rms_norm_eps``);
- its feed-forward block is sparse when ``num_experts > 1`` and ``i % expert_layer_period ==
  expert_layer_offset``: a softmax router (``router``) picks ``num_experts_per_tok`` experts,
  whose probabilities are *not* renormalized; otherwise a SwiGLU MLP;
- pre-norm layers (``input_layernorm``, ``pre_ff_layernorm``), ``model.final_layernorm``.

Checkpoint names map onto the Llama / sparse-MoE modules (``feed_forward`` -> ``mlp``,
``router`` -> ``gate``, per-expert ``gate_proj``/``up_proj``/``down_proj`` into the stacked
experts). Only the attention layers have a KV cache; the mamba layers carry a state per
request.

Tensor parallel: attention, MLPs, experts, embeddings and LM head as the other MoE models';
each mixer keeps ``intermediate / N`` channels (:mod:`~chassis.core.layers.mamba_mixer`:
``x_proj``'s and ``out_proj``'s partial outputs summed over the group; the ``dt``/``B``/``C``
norms whole on every rank).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.granitemoehybrid import NoPEAttention
from chassis.builtin_plugins.models.hybrid_layer import HybridDecoderLayer, hybrid_state_specs
from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaMLP
from chassis.builtin_plugins.models.sparse_moe import MoeSpec, SparseMoeBlock, SparseMoeForCausalLM
from chassis.core.layers.mamba2_mixer import (
    ShardedMixer,
    mamba2_checkpoint_part,
    mamba2_mixers,
)
from chassis.core.layers.mamba_mixer import MambaMixer, MambaSpec
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.model_interface import ModelBuildContext
from chassis.core.request_state_cache import RequestStateSpec


def jamba_layer_is_attention(hf_config: Any) -> list[bool]:
    """Per layer, whether it mixes with attention (else mamba); a ``ValueError`` for an
    offset not below its period."""
    period, offset = int(hf_config.attn_layer_period), int(hf_config.attn_layer_offset)
    if not 0 <= offset < period:
        raise ValueError(
            f"config attn_layer_offset ({offset}) must be in [0, attn_layer_period = {period})"
        )
    return [i % period == offset for i in range(int(hf_config.num_hidden_layers))]


def jamba_mamba_spec(hf_config: Any) -> MambaSpec:
    """The mixer of a ``JambaConfig`` (``mamba_*`` fields)."""
    hidden = int(hf_config.hidden_size)
    rank = hf_config.mamba_dt_rank
    return MambaSpec(
        hidden_size=hidden,
        intermediate_size=int(hf_config.mamba_expand) * hidden,
        d_state=int(hf_config.mamba_d_state),
        d_conv=int(hf_config.mamba_d_conv),
        dt_rank=-(-hidden // 16) if rank == "auto" else int(rank),
        conv_bias=bool(hf_config.mamba_conv_bias),
        proj_bias=bool(hf_config.mamba_proj_bias),
        bcdt_norm="weighted",
        bcdt_norm_eps=float(hf_config.rms_norm_eps),
    )


class JambaDecoderLayer(HybridDecoderLayer):
    """A Jamba layer: a Mamba-1 mixer (``mamba``) or attention (``self_attn``), then a
    dense or mixture-of-experts feed-forward block (``mlp``)."""

    state_mixer_name = "mamba"
    mamba: MambaMixer | None
    state_mixer_cls = MambaMixer


class JambaForCausalLM(SparseMoeForCausalLM):
    """``JambaForCausalLM`` checkpoints.

    Attention layer ``j`` (counting attention layers only) reads KV cache ``j``
    (:attr:`num_attention_layers` of them); mamba layer ``m`` holds request-state tensors
    ``2m`` (conv) and ``2m + 1`` (SSM). Refused when built: a ``hidden_act`` other than
    ``silu``, a layer offset not below its period, shapes that do not fit (or do not split
    over ``--tensor-parallel-size``).
    """

    has_recurrent_state = True
    checkpoint_renames = (
        (".feed_forward.router.", ".mlp.gate."),
        (".feed_forward.", ".mlp."),
        (".pre_ff_layernorm.", ".post_attention_layernorm."),
        ("model.final_layernorm.", "model.norm."),
    )

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec.from_config(hf_config, sliding_window=None)

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoeSpec:
        return MoeSpec(
            num_experts=int(hf_config.num_experts),
            top_k=int(hf_config.num_experts_per_tok),
            intermediate_size=int(hf_config.intermediate_size),
            renormalize=False,
            round_weights_to_model_dtype=True,
            intermediate_size_field="intermediate_size",
        )

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> nn.Module:
        self.is_attention = jamba_layer_is_attention(hf_config)
        self.mamba_spec = jamba_mamba_spec(hf_config)
        self.state_dtype = build_ctx.dtype
        return super().build_decoder(hf_config, build_ctx)

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> JambaDecoderLayer:
        before = self.is_attention[:layer_idx]
        mixer: nn.Module
        if self.is_attention[layer_idx]:
            mixer = NoPEAttention(self.spec, rotary_emb, sum(before), build_ctx)
        else:
            num_mamba_before = layer_idx - sum(before)
            mixer = MambaMixer(self.mamba_spec, state_index=2 * num_mamba_before)
        return JambaDecoderLayer(self.spec, mixer, self.make_mlp(layer_idx))

    def make_mlp(self, layer_idx: int) -> nn.Module:
        cfg = self.hf_config
        period, offset = int(cfg.expert_layer_period), int(cfg.expert_layer_offset)
        if not 0 <= offset < period:
            raise ValueError(
                f"config expert_layer_offset ({offset}) must be in [0, expert_layer_period = "
                f"{period})"
            )
        moe = self.moe_spec(cfg)
        if moe.num_experts > 1 and layer_idx % period == offset:
            return SparseMoeBlock(self.spec, moe)
        return LlamaMLP(self.spec)

    @property
    def num_attention_layers(self) -> int:
        return sum(jamba_layer_is_attention(self.hf_config))

    def request_state_specs(self) -> list[RequestStateSpec]:
        return hybrid_state_specs(self.model.layers, self.state_dtype)

    @classmethod
    def check_tensor_parallel(cls, hf_config: Any, size: int) -> None:
        inner = jamba_mamba_spec(hf_config).intermediate_size
        if inner % size:
            raise ValueError(
                f"the Mamba mixer's intermediate_size ({inner}) is not divisible by "
                f"--tensor-parallel-size {size}"
            )

    @functools.cached_property
    def _mamba_mixers(self) -> dict[str, ShardedMixer]:
        return mamba2_mixers(self)

    def _tensor_parallel_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """As Llama's, and a mixer's tensors cut by its ``checkpoint_part``."""
        if ".mamba." in name:
            return mamba2_checkpoint_part(self._mamba_mixers, name, tensor)
        return super()._tensor_parallel_slice(name, tensor)
