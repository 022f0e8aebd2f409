"""Phi-3: the Llama decoder with fused projections in the checkpoint, partial RoPE, LongRoPE.

Phi-3/3.5-mini and Phi-4-mini are Llama-shaped: pre-norm RMSNorm, SwiGLU, no biases. They
differ in three places, all handled outside the decoder itself:

- the checkpoint stores ``qkv_proj`` (q rows, then k, then v) and ``gate_up_proj`` (gate
  rows, then up) already fused. :meth:`Phi3ForCausalLM.load_weights` cuts them into the
  separate q/k/v and gate/up tensors, so the Llama loader shards each part over a
  tensor-parallel group exactly as it shards separate checkpoint tensors;
- ``partial_rotary_factor`` (Phi-4-mini: 0.75) rotates only the first part of each head and
  ``rope_type: longrope`` scales the frequencies (both in
  :mod:`chassis.core.layers.rotary`);
- ``sliding_window`` (Phi-3-mini-4k: 2047) applies to every layer, as for Mistral.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaForCausalLM
from chassis.core import parallel_state
from chassis.core.model_interface import LoRASlice

#: fused checkpoint projection -> the separate projections it stacks, in row order
FUSED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


class Phi3ForCausalLM(LlamaForCausalLM):
    """``Phi3ForCausalLM`` checkpoints (Phi-3-mini/medium, Phi-3.5-mini, Phi-4-mini)."""

    #: the checkpoint's modules are the merged ones: LoRA adapters adapt them whole
    lora_merged_projections: dict[str, tuple[str, ...]] = {}

    def lora_slices(self, module_name: str, module: nn.Module) -> list[LoRASlice]:
        """As Llama's, refused under tensor parallelism: an adapter's fused Q/K/V (or
        gate/up) B would have to be cut per part, which is not implemented."""
        slices = super().lora_slices(module_name, module)
        if slices and parallel_state.tp_size() > 1:
            raise ValueError(
                "LoRA adapters on Phi-3 are not supported with --tensor-parallel-size > 1 "
                "(its fused projections)"
            )
        return slices

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As :meth:`LlamaForCausalLM.load_weights`, with each fused ``qkv_proj`` and
        ``gate_up_proj`` tensor first split into its parts (:func:`split_fused`)."""

        def unfused() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                yield from split_fused(name, tensor, self.full_spec)

        return super().load_weights(unfused())


def split_fused(
    name: str, tensor: torch.Tensor, spec: DecoderSpec
) -> list[tuple[str, torch.Tensor]]:
    """A Phi-3 checkpoint tensor as Llama-named tensors: ``...qkv_proj.weight`` becomes
    ``...q_proj.weight``, ``...k_proj.weight`` and ``...v_proj.weight`` (row slices, views),
    ``...gate_up_proj.weight`` becomes ``gate_proj`` and ``up_proj``; any other tensor is
    returned as it is.

    ``spec`` is the whole (unsharded) layer's: the fused tensors hold every head. A fused
    tensor whose row count does not match it is a ``ValueError``.
    """
    parts = name.split(".")
    fused = next((i for i, part in enumerate(parts) if part in FUSED_PROJECTIONS), None)
    if fused is None:
        return [(name, tensor)]
    q_size = spec.num_heads * spec.head_dim
    kv_size = spec.num_kv_heads * spec.head_dim
    if parts[fused] == "qkv_proj":
        sizes = [q_size, kv_size, kv_size]
    else:
        sizes = [spec.intermediate_size, spec.intermediate_size]
    if tensor.shape[0] != sum(sizes):
        raise ValueError(
            f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, expected {sum(sizes)} "
            f"({' + '.join(map(str, sizes))}; does config.json match the weights?)"
        )
    names = FUSED_PROJECTIONS[parts[fused]]
    return [
        (".".join([*parts[:fused], part_name, *parts[fused + 1 :]]), part)
        for part_name, part in zip(names, tensor.split(sizes), strict=True)
    ]
