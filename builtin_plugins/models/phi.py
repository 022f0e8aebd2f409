"""Phi (microsoft/phi-1, phi-1_5, phi-2): attention and MLP in parallel off one LayerNorm,
partial RoPE, biases everywhere.

As HF transformers' ``Phi`` code defines it, a layer is::

    x = input_layernorm(h);  h = h + dense(attn(x)) + fc2(gelu(fc1(x)))

(:class:`~chassis.builtin_plugins.models.parallel_residual.ParallelResidualLayer` with one
shared norm), and it differs from Llama in:

- every norm is ``nn.LayerNorm`` with a bias over ``layer_norm_eps``; the final one is
  ``model.final_layernorm``;
- q/k/v and the output projection ``dense`` always have biases; ``fc1``/``fc2`` too, with
  ``hidden_act`` ``gelu_new`` (the released checkpoints) between them;
- RoPE rotates the first ``head_dim * partial_rotary_factor`` dimensions (HF's default
  0.5), rotate-half layout;
- ``qk_layernorm`` (off in the released checkpoints) puts one ``nn.LayerNorm`` over
  ``head_dim``, shared by all heads, on q and one on k before RoPE;
- the LM head has a bias (and is untied unless ``tie_word_embeddings``).

Dropouts (``resid_pdrop``, ``embd_pdrop``, ``attention_dropout``) are training-only.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaModel
from chassis.builtin_plugins.models.parallel_residual import (
    CheckpointRenames,
    ParallelResidualLayer,
    gelu_approximate,
    make_attention,
)
from chassis.builtin_plugins.models.starcoder2 import LayerNorm, Starcoder2ForCausalLM
from chassis.core.layers.rotary import RotaryEmbedding, rope_parameters
from chassis.core.model_interface import ModelBuildContext

#: HF's ``PhiConfig`` default for ``partial_rotary_factor``
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


class PhiForCausalLM(CheckpointRenames, Starcoder2ForCausalLM):
    """``PhiForCausalLM`` checkpoints (phi-1, phi-1_5, phi-2 and their fine-tunes).

    Built in Llama's layout (``self_attn.o_proj``, ``mlp.c_fc``/``c_proj`` as StarCoder2's
    GELU MLP, ``model.norm``) with the checkpoint's names renamed on load. Tensor
    parallelism and LoRA are Llama's and StarCoder2's cuts; the q/k LayerNorms are whole on
    every rank (one per tensor, shared by the heads), the LM head's bias is cut by
    vocabulary rows.
    """

    checkpoint_renames = (
        (".model.final_layernorm.", ".model.norm."),
        (".self_attn.dense.", ".self_attn.o_proj."),
        (".self_attn.q_layernorm.", ".self_attn.q_norm."),
        (".self_attn.k_layernorm.", ".self_attn.k_norm."),
        (".mlp.fc1.", ".mlp.c_fc."),
        (".mlp.fc2.", ".mlp.c_proj."),
    )
    ignored_checkpoint_suffixes = (".rotary_emb.inv_freq",)
    lm_head_bias = True

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        """Llama's fields with ``layer_norm_eps``, biases on every projection, partial RoPE
        (default 0.5) and ``qk_layernorm``."""
        gelu_approximate(getattr(hf_config, "hidden_act", "gelu_new"), "Phi")
        rope = rope_parameters(hf_config)
        if rope.get("partial_rotary_factor") is None:
            rope["partial_rotary_factor"] = DEFAULT_PARTIAL_ROTARY_FACTOR
        return DecoderSpec.from_config(
            hf_config,
            activation=None,  # a GELU, checked above
            rms_norm_eps=float(getattr(hf_config, "layer_norm_eps", 1e-5)),
            rope=rope,
            qkv_bias=True,
            o_bias=True,
            mlp_bias=True,
            qk_norm=bool(getattr(hf_config, "qk_layernorm", False)),
            sliding_window=None,
        )

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> nn.Module:
        self.gelu_approximate = gelu_approximate(
            getattr(hf_config, "hidden_act", "gelu_new"), "Phi"
        )
        return LlamaModel(
            hf_config, self.spec, build_ctx, self.make_layer, norm_class=self.norm_class
        )

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> nn.Module:
        attention = make_attention(self.spec, rotary_emb, layer_idx, build_ctx)
        if self.spec.qk_norm:  # LayerNorms with a bias over head_dim, not Llama's RMSNorms
            attention.q_norm = LayerNorm(self.spec.head_dim, self.spec.rms_norm_eps)
            attention.k_norm = LayerNorm(self.spec.head_dim, self.spec.rms_norm_eps)
        return ParallelResidualLayer(
            self.spec,
            attention,
            self.make_mlp(layer_idx),
            self.norm_class,
            parallel=True,
            shared_norm=True,
        )
