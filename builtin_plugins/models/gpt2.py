"""GPT-2 (gpt2, gpt2-medium/-large/-xl, distilgpt2): a pre-norm learned-position decoder.

As HF transformers' ``modeling_gpt2.py`` defines it (see :mod:`.learned_positions` for the
shared layout), GPT-2 differs from Llama in:

- learned absolute positions (``wpe``, ``n_positions`` rows), no RoPE;
- LayerNorm with bias (``layer_norm_epsilon``) for ``ln_1``, ``ln_2`` and ``ln_f``;
- a non-gated MLP ``c_proj(act(c_fc(x)))`` (``activation_function``: ``gelu_new``, the
  tanh GELU) of ``n_inner`` (default ``4 * n_embd``) columns, biases everywhere;
- ``Conv1D`` projections, stored ``[in, out]`` (transposed here on load), with q, k and v
  fused in ``c_attn`` (split into q/k/v rows here, so tensor parallelism cuts heads as
  Llama's);
- ``scale_attn_weights`` (``1/sqrt(head_dim)``, else no scale) and
  ``scale_attn_by_inverse_layer_idx`` (a further ``1/(layer + 1)``) set the attention
  scale; ``reorder_and_upcast_attn`` is accepted and ignored: it only changes how HF's
  eager attention rounds (scores upcast to float32), and HF's default SDPA path ignores it
  too.

Checkpoint names are ``transformer.*`` or bare (``h.*``, ``wte``, ...: the hub's gpt2);
``h.{i}.attn.bias`` / ``masked_bias`` (causal-mask buffers of old checkpoints) are skipped.
Cross-attention (``add_cross_attention``) is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
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
from chassis.core.model_interface import LoRASlice, ModelBuildContext

#: top-level GPT-2 module names -> the internal ones
_TOP_RENAMES = {"wte": "model.embed_tokens", "wpe": "model.embed_positions", "ln_f": "model.norm"}
#: per-layer module names -> the internal ones (``attn.c_attn`` is split, see below)
_LAYER_RENAMES = {
    "ln_1": "input_layernorm",
    "ln_2": "post_attention_layernorm",
    "attn.c_proj": "self_attn.o_proj",
    "mlp.c_fc": "mlp.c_fc",
    "mlp.c_proj": "mlp.c_proj",
}
#: per-layer buffers of older checkpoints (the causal mask), not weights
_SKIPPED = frozenset({"attn.bias", "attn.masked_bias"})


class GPT2LMHeadModel(LearnedPositionsForCausalLM):
    """``GPT2LMHeadModel`` checkpoints (and DistilGPT2, saved as one)."""

    arch_name = "GPT2LMHeadModel"

    def lora_slices(self, module_name: str, module: nn.Module) -> list[LoRASlice]:
        """None: no layer takes LoRA adapters. PEFT saves GPT-2 adapters (on its ``Conv1D``
        layers) with ``fan_in_fan_out``, which the adapter reader refuses for every model."""
        return []

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        """Shapes from ``n_embd``, ``n_head`` and ``n_inner``; biases everywhere; the
        norms' eps ``layer_norm_epsilon``."""
        activation_of(hf_config, "GPT-2")
        if getattr(hf_config, "add_cross_attention", False):
            raise ValueError("GPT-2 add_cross_attention (an encoder-decoder) is not supported")
        hidden = int(hf_config.n_embd)
        heads = int(hf_config.n_head)
        if hidden % heads:
            raise ValueError(f"GPT-2 n_embd {hidden} is not a multiple of n_head {heads}")
        return DecoderSpec(
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            intermediate_size=int(getattr(hf_config, "n_inner", None) or 4 * hidden),
            rms_norm_eps=float(getattr(hf_config, "layer_norm_epsilon", 1e-5)),
            max_position=int(hf_config.n_positions),
            rope={},
            qkv_bias=True,
            o_bias=True,
            mlp_bias=True,
        )

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> nn.Module:
        check_max_len(build_ctx, self.spec.max_position, "GPT-2")
        act = activation_of(hf_config, "GPT-2")
        scale = self.spec.head_dim**-0.5 if getattr(hf_config, "scale_attn_weights", True) else 1.0
        by_layer = bool(getattr(hf_config, "scale_attn_by_inverse_layer_idx", False))
        layers: list[nn.Module] = [
            LearnedPositionsLayer(
                self.spec,
                i,
                build_ctx,
                PlainMLP(self.spec, act),
                pre_norm=True,
                attention_scale=scale / (i + 1) if by_layer else scale,
            )
            for i in range(int(hf_config.n_layer))
        ]
        return LearnedPositionsDecoder(
            hf_config,
            self.spec,
            layers,
            embed_dim=self.spec.hidden_size,
            num_positions=self.spec.max_position,
        )

    def checkpoint_tensors(
        self, name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``[transformer.]X`` -> internal names; ``Conv1D`` weights (2-D, ``[in, out]``)
        transposed to ``nn.Linear``'s ``[out, in]``; ``c_attn`` split into ``q_proj``,
        ``k_proj`` and ``v_proj``; mask buffers skipped."""
        if name == "lm_head.weight":
            yield name, tensor
            return
        rest = name.removeprefix("transformer.")
        top, _, param = rest.partition(".")
        if top in _TOP_RENAMES:
            yield f"{_TOP_RENAMES[top]}.{param}", tensor
            return
        parts = rest.split(".")
        if top != "h" or len(parts) < 4:
            raise self.unknown(name)
        prefix = f"model.layers.{parts[1]}."
        module, param = ".".join(parts[2:-1]), parts[-1]
        if f"{module}.{param}" in _SKIPPED:
            return
        if param == "weight" and module in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            tensor = tensor.t()  # Conv1D stores [in, out]
        if module == "attn.c_attn":
            q, k, v = tensor.chunk(3, dim=0)
            for proj, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                yield f"{prefix}self_attn.{proj}.{param}", part
            return
        if module not in _LAYER_RENAMES:
            raise self.unknown(name)
        yield f"{prefix}{_LAYER_RENAMES[module]}.{param}", tensor
