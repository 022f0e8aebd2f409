"""OPT (facebook/opt-125m ... opt-66b): a learned-position decoder with biases and ReLU.

As HF transformers' ``modeling_opt.py`` defines it (see :mod:`.learned_positions` for the
shared layout), OPT differs from Llama in:

- learned absolute positions (``embed_positions``, ``max_position_embeddings + 2`` rows:
  position ``p`` reads row ``p + 2``), no RoPE;
- LayerNorm with bias (eps 1e-5) for every norm; ``do_layer_norm_before`` (true for all
  released sizes but opt-350m) puts them before each block, else after each residual add,
  and then there is no final norm;
- ``word_embed_proj_dim`` != ``hidden_size`` (opt-350m): bias-free ``project_in`` after
  the token embedding and ``project_out`` before the tied LM head;
- a non-gated MLP ``fc2(act(fc1(x)))`` (``activation_function``: ``relu``), and
  ``enable_bias`` on q/k/v/out_proj and fc1/fc2.

Checkpoint names are ``model.decoder.*`` (``decoder.*`` in some conversions) and
``lm_head.weight`` (skipped when tied).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from chassis.builtin_plugins.models.learned_positions import (
    LearnedPositionsDecoder,
    LearnedPositionsForCausalLM,
    LearnedPositionsLayer,
    PlainMLP,
    activation_of,
    check_max_len,
)
from chassis.builtin_plugins.models.llama import DecoderSpec
from chassis.core.model_interface import ModelBuildContext

#: OPT keeps the first 2 rows of its position table unused
POSITION_OFFSET = 2


class OPTForCausalLM(LearnedPositionsForCausalLM):
    """``OPTForCausalLM`` checkpoints; both layer-norm orders and the projected embedding.

    Refused with a ``ValueError``: ``layer_norm_elementwise_affine: false`` and an
    activation other than ReLU / GELU (:data:`.learned_positions.ACTIVATIONS`).
    """

    arch_name = "OPTForCausalLM"
    # applied in order: the decoder's final norm is renamed before the layers' norms of the
    # same name; the reverse (LoRA module names) gives ``model.decoder.*`` back
    checkpoint_renames = (
        (".decoder.final_layer_norm.", ".decoder.norm."),
        (".model.decoder.", ".model."),
        (".self_attn.out_proj.", ".self_attn.o_proj."),
        (".self_attn_layer_norm.", ".input_layernorm."),
        (".final_layer_norm.", ".post_attention_layernorm."),
        (".fc1.", ".mlp.c_fc."),
        (".fc2.", ".mlp.c_proj."),
    )

    def ours(self, checkpoint_name: str) -> str:
        """As :class:`~.parallel_residual.CheckpointRenames` renames, with the ``decoder.*``
        names of some conversions read as ``model.decoder.*``."""
        if checkpoint_name.startswith("decoder."):
            checkpoint_name = "model." + checkpoint_name
        return super().ours(checkpoint_name)

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        """Shapes from ``hidden_size``, ``num_attention_heads`` and ``ffn_dim``;
        ``enable_bias`` on every projection; LayerNorm eps 1e-5 (``nn.LayerNorm``'s, which
        HF's OPT uses)."""
        activation_of(hf_config, "OPT")
        if not getattr(hf_config, "layer_norm_elementwise_affine", True):
            raise ValueError(
                "OPT layer_norm_elementwise_affine false (LayerNorm without weight and "
                "bias) is not supported"
            )
        hidden = int(hf_config.hidden_size)
        heads = int(hf_config.num_attention_heads)
        if hidden % heads:
            raise ValueError(
                f"OPT hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
            )
        bias = bool(getattr(hf_config, "enable_bias", True))
        return DecoderSpec(
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            intermediate_size=int(hf_config.ffn_dim),
            rms_norm_eps=1e-5,
            max_position=int(hf_config.max_position_embeddings),
            rope={},
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=bias,
        )

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> nn.Module:
        check_max_len(build_ctx, self.spec.max_position, "OPT")
        act = activation_of(hf_config, "OPT")
        pre_norm = bool(getattr(hf_config, "do_layer_norm_before", True))
        layers: list[nn.Module] = [
            LearnedPositionsLayer(
                self.spec, i, build_ctx, PlainMLP(self.spec, act), pre_norm=pre_norm
            )
            for i in range(int(hf_config.num_hidden_layers))
        ]
        embed_dim = int(getattr(hf_config, "word_embed_proj_dim", None) or self.spec.hidden_size)
        final_norm = pre_norm and not getattr(hf_config, "_remove_final_layer_norm", False)
        return LearnedPositionsDecoder(
            hf_config,
            self.spec,
            layers,
            embed_dim=embed_dim,
            num_positions=self.spec.max_position + POSITION_OFFSET,
            position_offset=POSITION_OFFSET,
            final_norm=final_norm,
        )
