"""Seed-OSS (ByteDance-Seed/Seed-OSS-36B): the Llama decoder with its own bias flags.

As HF transformers' ``SeedOss`` code defines it, the layers are Llama's (pre-norm RMSNorm,
SwiGLU, full attention, rotate-half RoPE over the whole head). Only the biases are switched
differently:

- ``attention_bias`` (default true) puts biases on q, k and v;
- ``attention_out_bias`` (default false) puts one on ``o_proj`` (Llama's ``attention_bias``
  covers both);
- ``mlp_bias`` (default false) on gate, up and down, as in Llama.

The dropouts of the config (``attention_dropout``, ``residual_dropout``) are training-only.
Weight loading and tensor parallelism are :class:`LlamaForCausalLM`'s (an ``o_proj`` or
``down_proj`` bias is added by rank 0 only). HF's Seed-OSS has no sliding window (a
``sliding_window`` in the config is ignored) and its default RoPE rotates whole heads: a
``partial_rotary_factor`` below 1 is refused.
"""

from __future__ import annotations

from typing import Any

from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaForCausalLM


class SeedOssForCausalLM(LlamaForCausalLM):
    """``SeedOssForCausalLM`` checkpoints (Seed-OSS-36B base and instruct)."""

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        spec = DecoderSpec.from_config(
            hf_config,
            qkv_bias=bool(getattr(hf_config, "attention_bias", True)),
            o_bias=bool(getattr(hf_config, "attention_out_bias", False)),
            sliding_window=None,
        )
        partial = spec.rope.get("partial_rotary_factor")
        if partial is not None and float(partial) != 1.0:
            raise ValueError(
                f"partial_rotary_factor {partial} is not supported for Seed-OSS (HF's "
                "SeedOss rotates whole heads); fix config.json"
            )
        return spec
