"""IBM Bamba (``BambaForCausalLM``: ibm-ai-platform/Bamba-9B and its versions): Mamba2 layers
with attention at ``attn_layer_indices``, a dense SwiGLU MLP in every layer.

As HF transformers' ``Bamba`` code defines it, the layers are Granite 4.0-H's
(:mod:`~chassis.builtin_plugins.models.granitemoehybrid`) without Granite's multipliers:
the same Mamba2 mixer (``mamba.*``), attention scaled by ``head_dim ** -0.5`` with RoPE on the
first half of each head (``partial_rotary_factor`` 0.5, which Bamba's config always sets), and
the checkpoint names its blocks ``feed_forward`` (gate/up/down projections),
``pre_ff_layernorm`` and ``model.final_layernorm``. Tensor parallelism is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.granitemoehybrid import GraniteMoeHybridForCausalLM
from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaMLP

#: (checkpoint substring, ours), applied in order to every checkpoint name
_RENAMES = (
    (".feed_forward.", ".mlp."),
    (".pre_ff_layernorm.", ".post_attention_layernorm."),
    ("model.final_layernorm.", "model.norm."),
)


class BambaForCausalLM(GraniteMoeHybridForCausalLM):
    """``BambaForCausalLM`` checkpoints. Layer kinds come from ``attn_layer_indices`` (the
    config's ``layers_block_type``); refused as Granite 4.0-H's options are."""

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec.from_config(hf_config, sliding_window=None)

    @classmethod
    def uses_rope_for(cls, hf_config: Any) -> bool:
        return True  # Bamba's attention layers always rotate (part of) each head

    def attention_scale(self) -> float | None:
        return None  # head_dim ** -0.5

    def make_mlp(self, layer_idx: int) -> nn.Module:
        return LlamaMLP(self.spec)

    def checkpoint_tensors(
        self, name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for old, new in _RENAMES:
            name = name.replace(old, new)
        yield name, tensor
