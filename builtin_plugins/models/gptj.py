"""GPT-J (EleutherAI/gpt-j-6b and its fine-tunes): one LayerNorm per layer feeding attention
and MLP in parallel, interleaved partial RoPE, an LM head with a bias.

As HF transformers' ``GPTJ`` code defines it, a layer is::

    x = ln_1(h);  h = h + out_proj(attn(x)) + fc_out(gelu(fc_in(x)))

(:class:`~chassis.builtin_plugins.models.parallel_residual.ParallelResidualLayer` with one
shared norm), and it differs from Llama in:

- the norms (``ln_1``, ``ln_f``) are ``nn.LayerNorm`` with a bias over
  ``layer_norm_epsilon``;
- q/k/v and ``out_proj`` have no bias; ``fc_in``/``fc_out`` do, with
  ``activation_function`` (``gelu_new``) between them and ``n_inner`` (default
  ``4 * n_embd``) columns;
- RoPE rotates the first ``rotary_dim`` dimensions of each head (all of them when it is
  null) in the *interleaved* layout: dimension ``2i`` pairs with ``2i + 1``
  (:func:`~chassis.core.layers.rotary.rotate_interleaved`), base 10000;
- the LM head has a bias.

The checkpoint's ``transformer.*`` names are renamed to the Llama layout on load.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaModel, head_dim_of
from chassis.builtin_plugins.models.parallel_residual import (
    CheckpointRenames,
    ParallelResidualLayer,
    gelu_approximate,
    make_attention,
)
from chassis.builtin_plugins.models.starcoder2 import Starcoder2ForCausalLM
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.model_interface import ModelBuildContext

#: GPT-J's fixed RoPE base (HF's ``create_sinusoidal_positions``)
ROPE_THETA = 10000.0


def gptj_rope(hf_config: Any) -> dict[str, Any]:
    """The RoPE parameters :class:`RotaryEmbedding` reads: interleaved, base 10000, over the
    first ``rotary_dim`` dimensions; a ``ValueError`` when ``rotary_dim`` is not an even
    number up to ``head_dim``."""
    head_dim = head_dim_of(hf_config)
    rotary_dim = getattr(hf_config, "rotary_dim", None) or head_dim
    if not isinstance(rotary_dim, int) or not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(
            f"GPT-J rotary_dim {rotary_dim!r} must be an even number of dimensions up to "
            f"head_dim ({head_dim})"
        )
    factor = rotary_dim / head_dim
    if int(head_dim * factor) != rotary_dim:  # float rounding: never in practice
        raise ValueError(f"GPT-J rotary_dim {rotary_dim} of head_dim {head_dim} is not supported")
    return {
        "rope_theta": ROPE_THETA,
        "rope_type": "default",
        "partial_rotary_factor": factor,
        "interleaved": True,
    }


class _WithIntermediateSize:
    """``hf_config`` with ``intermediate_size`` (``n_inner``, default ``4 * n_embd``), the
    name :meth:`DecoderSpec.from_config` reads."""

    def __init__(self, hf_config: Any) -> None:
        self._config = hf_config
        self.intermediate_size = int(
            getattr(hf_config, "n_inner", None) or 4 * int(hf_config.hidden_size)
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


class GPTJForCausalLM(CheckpointRenames, Starcoder2ForCausalLM):
    """``GPTJForCausalLM`` checkpoints, built in Llama's layout (``mlp.c_fc``/``c_proj`` as
    StarCoder2's GELU MLP). Tensor parallelism and LoRA are Llama's and StarCoder2's cuts;
    the LM head's bias is cut by vocabulary rows."""

    checkpoint_renames = (
        (".transformer.wte.", ".model.embed_tokens."),
        (".transformer.ln_f.", ".model.norm."),
        (".transformer.h.", ".model.layers."),
        (".ln_1.", ".input_layernorm."),
        (".attn.q_proj.", ".self_attn.q_proj."),
        (".attn.k_proj.", ".self_attn.k_proj."),
        (".attn.v_proj.", ".self_attn.v_proj."),
        (".attn.out_proj.", ".self_attn.o_proj."),
        (".mlp.fc_in.", ".mlp.c_fc."),
        (".mlp.fc_out.", ".mlp.c_proj."),
    )
    ignored_checkpoint_suffixes = (".attn.bias", ".attn.masked_bias")
    lm_head_bias = True

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        """Llama's fields from GPT-J's (``n_inner``, ``layer_norm_epsilon``), no attention
        biases, MLP biases and :func:`gptj_rope`."""
        activation = getattr(hf_config, "activation_function", "gelu_new")
        gelu_approximate(activation, "GPT-J", "activation_function")
        return DecoderSpec.from_config(
            _WithIntermediateSize(hf_config),
            activation=None,  # a GELU, checked above
            rms_norm_eps=float(getattr(hf_config, "layer_norm_epsilon", 1e-5)),
            rope=gptj_rope(hf_config),
            qkv_bias=False,
            o_bias=False,
            mlp_bias=True,
            sliding_window=None,
        )

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> nn.Module:
        self.gelu_approximate = gelu_approximate(
            getattr(hf_config, "activation_function", "gelu_new"), "GPT-J", "activation_function"
        )
        return LlamaModel(
            hf_config, self.spec, build_ctx, self.make_layer, norm_class=self.norm_class
        )

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> nn.Module:
        return ParallelResidualLayer(
            self.spec,
            make_attention(self.spec, rotary_emb, layer_idx, build_ctx),
            self.make_mlp(layer_idx),
            self.norm_class,
            parallel=True,
            shared_norm=True,
        )
