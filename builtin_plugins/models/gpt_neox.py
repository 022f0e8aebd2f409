"""GPT-NeoX (EleutherAI gpt-neox-20b, the Pythia suite): LayerNorm, a GELU MLP, partial
RoPE, a fused per-head Q/K/V and (by default) a parallel residual.

As HF transformers' ``GPTNeoX`` code defines it, a layer is::

    use_parallel_residual (default):  h = h + attn(ln1(h)) + mlp(ln2(h))
    otherwise:                        h = h + attn(ln1(h));  h = h + mlp(ln2(h))

(:class:`~chassis.builtin_plugins.models.parallel_residual.ParallelResidualLayer`, two
norms), and it differs from Llama in:

- every norm is ``nn.LayerNorm`` with a bias over ``layer_norm_eps``;
- the MLP is ``dense_4h_to_h(act(dense_h_to_4h(x)))`` with biases (``hidden_act``: ``gelu``
  in the released checkpoints; ``gelu_new``/``gelu_pytorch_tanh`` accepted);
- ``attention.query_key_value`` holds Q, K and V interleaved *per head*: its output rows
  are ``[heads, 3, head_dim]`` (head 0's q, k, v rows, then head 1's). Loading cuts it
  into Llama's separate q/k/v tensors (:func:`split_neox_qkv`), which the Llama loader then
  merges and shards by head as for any checkpoint;
- RoPE rotates the first ``head_dim * partial_rotary_factor`` dimensions of each head
  (``rotary_pct`` in the original configs; HF's default 0.25), rotate-half layout;
- ``attention_bias`` (default true) puts a bias on ``query_key_value`` and ``dense``;
- the LM head is ``embed_out`` (untied unless ``tie_word_embeddings``), without a bias.

Not supported: LoRA adapters on ``query_key_value`` (their rows are in the per-head order,
which a merged Q/K/V slice cannot express; adapters on ``dense`` and the MLP load).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaModel
from chassis.builtin_plugins.models.parallel_residual import (
    CheckpointRenames,
    ParallelResidualLayer,
    gelu_approximate,
    make_attention,
)
from chassis.builtin_plugins.models.starcoder2 import Starcoder2ForCausalLM
from chassis.core.layers.rotary import RotaryEmbedding, rope_parameters
from chassis.core.model_interface import LoRASlice, ModelBuildContext

#: HF's ``GPTNeoXConfig`` default for ``rotary_pct`` / ``partial_rotary_factor``
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25


def split_neox_qkv(
    name: str, tensor: torch.Tensor, spec: DecoderSpec
) -> list[tuple[str, torch.Tensor]]:
    """``...query_key_value.{weight,bias}`` (rows ``[heads, 3, head_dim]``) as
    ``...q_proj``, ``...k_proj`` and ``...v_proj`` tensors of ``[heads * head_dim]`` rows
    each; a ``ValueError`` when the row count is not ``3 * heads * head_dim`` of the whole
    (unsharded) ``spec``."""
    heads, head_dim = spec.num_heads, spec.head_dim
    if tensor.shape[0] != 3 * heads * head_dim:
        raise ValueError(
            f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, expected "
            f"{3 * heads * head_dim} (3 * num_attention_heads * head_dim; does config.json "
            "match the weights?)"
        )
    per_head = tensor.reshape(heads, 3, head_dim, *tensor.shape[1:])
    prefix = name.removesuffix(".weight").removesuffix(".bias").rpartition(".")[0]
    suffix = name.rpartition(".")[2]
    return [
        (f"{prefix}.{proj}.{suffix}", per_head[:, i].reshape(heads * head_dim, *tensor.shape[1:]))
        for i, proj in enumerate(("q_proj", "k_proj", "v_proj"))
    ]


class GPTNeoXForCausalLM(CheckpointRenames, Starcoder2ForCausalLM):
    """``GPTNeoXForCausalLM`` checkpoints (Pythia, gpt-neox-20b and their fine-tunes).

    Built in Llama's layout (``model.layers.N.self_attn.qkv_proj``, ``mlp.c_fc`` /
    ``c_proj`` as StarCoder2's GELU MLP) with the checkpoint's names renamed on load.
    Tensor parallelism and LoRA are Llama's and StarCoder2's cuts.
    """

    checkpoint_renames = (
        (".gpt_neox.embed_in.", ".model.embed_tokens."),
        (".gpt_neox.final_layer_norm.", ".model.norm."),
        (".gpt_neox.layers.", ".model.layers."),
        (".attention.query_key_value.", ".self_attn.query_key_value."),
        (".attention.dense.", ".self_attn.o_proj."),
        (".mlp.dense_h_to_4h.", ".mlp.c_fc."),
        (".mlp.dense_4h_to_h.", ".mlp.c_proj."),
        (".embed_out.", ".lm_head."),
    )
    ignored_checkpoint_suffixes = (
        ".attention.bias",
        ".attention.masked_bias",
        ".rotary_emb.inv_freq",
    )

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        """Llama's fields with ``layer_norm_eps``, ``attention_bias`` on q/k/v/o, biases on
        the MLP and ``rotary_pct`` as the partial rotary factor (default 0.25)."""
        gelu_approximate(getattr(hf_config, "hidden_act", "gelu"), "GPT-NeoX")
        rope = rope_parameters(hf_config)
        if rope.get("partial_rotary_factor") is None:
            rope["partial_rotary_factor"] = float(
                getattr(hf_config, "rotary_pct", None) or DEFAULT_PARTIAL_ROTARY_FACTOR
            )
        base = getattr(hf_config, "rotary_emb_base", None)
        if base and not isinstance(getattr(hf_config, "rope_parameters", None), dict):
            rope["rope_theta"] = float(base)  # a config object from before transformers 5
        bias = bool(getattr(hf_config, "attention_bias", True))
        return DecoderSpec.from_config(
            hf_config,
            activation=None,  # a GELU, checked above
            rms_norm_eps=float(getattr(hf_config, "layer_norm_eps", 1e-5)),
            rope=rope,
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=True,
            sliding_window=None,
        )

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> nn.Module:
        self.gelu_approximate = gelu_approximate(
            getattr(hf_config, "hidden_act", "gelu"), "GPT-NeoX"
        )
        self.parallel_residual = bool(getattr(hf_config, "use_parallel_residual", True))
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
            parallel=self.parallel_residual,
            shared_norm=False,
        )

    def checkpoint_tensors(
        self, name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The fused per-head Q/K/V as separate q/k/v tensors (:func:`split_neox_qkv`)."""
        if ".query_key_value." in f".{name}":
            yield from split_neox_qkv(name, tensor, self.full_spec)
        else:
            yield name, tensor

    def lora_slices(self, module_name: str, module: nn.Module) -> list[LoRASlice]:
        """As the base class's, none for the merged Q/K/V (module docstring)."""
        if module_name.endswith(".qkv_proj"):
            return []
        return super().lora_slices(module_name, module)
