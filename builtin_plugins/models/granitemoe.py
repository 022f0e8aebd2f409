"""IBM Granite MoE (granite-3.0/3.1 1B-A400M and 3B-A800M): Granite's decoder with a
mixture of experts in place of every MLP.

As HF transformers' ``GraniteMoe`` code defines it, what differs from Llama:

- Granite's four multipliers (embedding, residual, attention scale, logits scaling;
  :class:`~chassis.builtin_plugins.models.granite.GraniteMultipliers`), applied as in
  :mod:`~chassis.builtin_plugins.models.granite`.
- Every layer's MLP is a mixture of ``num_local_experts`` SwiGLU experts of
  ``intermediate_size`` (``block_sparse_moe``). The router (``router.layer``) keeps the
  ``num_experts_per_tok`` largest logits and takes the softmax over those alone, in float32,
  rounded to the model dtype: the same weights as a softmax over all experts whose top-k
  are renormalized, which is how :class:`~chassis.core.layers.moe.FusedMoE` computes them.
- The checkpoint stores each layer's experts stacked: ``block_sparse_moe.input_linear.weight``
  ``[E, 2 * I, H]`` (each expert's gate rows, then its up rows) and
  ``block_sparse_moe.output_linear.weight`` ``[E, H, I]``. :meth:`GraniteMoeForCausalLM.
  load_weights` cuts them into per-expert matrices (views) so that each rank loads its
  share as for the other MoE models.

Tensor parallelism is :class:`~chassis.builtin_plugins.models.sparse_moe.
SparseMoeForCausalLM`'s: every rank holds every expert's share of the intermediate columns
(or, with ``--enable-expert-parallel``, whole experts: a contiguous range); the router is
whole on every rank. The stacked tensors hold every expert, so every rank reads them whole
and keeps its part.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.granite import GraniteForCausalLM
from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaMLP
from chassis.builtin_plugins.models.sparse_moe import MoeSpec, SparseMoeForCausalLM
from chassis.core import parallel_state
from chassis.core.layers.moe import FusedMoE

#: (checkpoint substring, ours), applied in order to every checkpoint name
_RENAMES = ((".block_sparse_moe.", ".mlp."), (".mlp.router.layer.", ".mlp.gate."))
#: the stacked expert tensors of a checkpoint's MoE block -> our per-expert projections
_STACKED_EXPERTS = {"input_linear": ("gate_proj", "up_proj"), "output_linear": ("down_proj",)}


class GraniteMoeBlock(nn.Module):
    """Router (``gate``), ``experts`` and, with ``shared_intermediate_size``, an always-on
    SwiGLU ``shared_mlp`` whose output is added (GraniteMoeShared).

    ``forward(x [T, hidden]) -> [T, hidden]``, summed over the tensor-parallel group (one
    all-reduce for the experts and the shared MLP together).
    """

    def __init__(self, spec: DecoderSpec, moe: MoeSpec, shared_intermediate_size: int) -> None:
        super().__init__()
        self.gate = nn.Linear(spec.hidden_size, moe.num_experts, bias=False)
        self.experts = FusedMoE(
            moe.num_experts,
            moe.top_k,
            spec.hidden_size,
            moe.intermediate_size,
            renormalize=moe.renormalize,
            round_weights_to_model_dtype=moe.round_weights_to_model_dtype,
            intermediate_size_field=moe.intermediate_size_field,
        )
        self.shared_mlp: LlamaMLP | None = None
        if shared_intermediate_size:
            _, share = parallel_state.shard(shared_intermediate_size, "shared_intermediate_size")
            self.shared_mlp = LlamaMLP(spec, share, reduce_output=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_mlp is not None:
            out = out + self.shared_mlp(x)
        # Each rank holds some columns of every expert (or some experts) and of the shared
        # MLP: the partial sums add up.
        return parallel_state.all_reduce(out)


class GraniteMoeForCausalLM(SparseMoeForCausalLM, GraniteForCausalLM):
    """``GraniteMoeForCausalLM`` checkpoints (ibm-granite/granite-3.0-1b-a400m,
    granite-3.0-3b-a800m, granite-3.1-1b-a400m, granite-3.1-3b-a800m; base and instruct).

    Granite's layers, multipliers and logits (:class:`~chassis.builtin_plugins.models.
    granite.GraniteForCausalLM`) with a :class:`GraniteMoeBlock` as every layer's ``mlp``;
    expert loading and tensor/expert parallelism from :class:`~chassis.builtin_plugins.
    models.sparse_moe.SparseMoeForCausalLM`. ``attention_bias`` is honoured (q, k, v and
    o); a ``sliding_window`` is ignored, as HF ignores it. Refused when the model is built:
    another ``hidden_act`` than ``silu``, a RoPE type the rotary layer does not implement,
    a ``logits_scaling`` of 0.
    """

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec.from_config(hf_config, sliding_window=None, mlp_bias=False)

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoeSpec:
        return MoeSpec(
            num_experts=int(hf_config.num_local_experts),
            top_k=int(hf_config.num_experts_per_tok),
            intermediate_size=int(hf_config.intermediate_size),
            renormalize=True,
            round_weights_to_model_dtype=True,
            intermediate_size_field="intermediate_size",
        )

    @classmethod
    def shared_intermediate_size(cls, hf_config: Any) -> int:
        """The shared MLP's intermediate size (0: none; GraniteMoe has none)."""
        return 0

    def make_mlp(self, layer_idx: int) -> nn.Module:
        return GraniteMoeBlock(
            self.spec, self.moe_spec(self.hf_config), self.shared_intermediate_size(self.hf_config)
        )

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As :meth:`SparseMoeForCausalLM.load_weights`, after :meth:`checkpoint_tensors`
        renamed and cut each checkpoint tensor."""

        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                yield from self.checkpoint_tensors(name, tensor)

        return super().load_weights(renamed())

    def checkpoint_tensors(
        self, name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """One checkpoint tensor as the tensors our loader takes: ``block_sparse_moe.`` is
        ``mlp.``, its ``router.layer`` is ``mlp.gate``, and the stacked ``input_linear`` /
        ``output_linear`` become ``mlp.experts.<e>.{gate,up,down}_proj.weight`` views (a
        ``ValueError`` when the stack's shape does not match the config)."""
        checkpoint_name = name
        for old, new in _RENAMES:
            name = name.replace(old, new)
        prefix, _, leaf = name.rpartition(".")
        block, _, stacked = prefix.rpartition(".")
        if leaf != "weight" or stacked not in _STACKED_EXPERTS or not block.endswith(".mlp"):
            yield name, tensor
            return
        moe = self.moe_spec(self.hf_config)
        inter, hidden = moe.intermediate_size, self.full_spec.hidden_size
        if stacked == "input_linear":
            expected = (moe.num_experts, 2 * inter, hidden)
        else:
            expected = (moe.num_experts, hidden, inter)
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"checkpoint tensor {checkpoint_name!r} has shape {tuple(tensor.shape)}, expected "
                f"{expected} (num_local_experts, intermediate_size and hidden_size; does "
                "config.json match the weights?)"
            )
        projections = _STACKED_EXPERTS[stacked]
        for expert in range(moe.num_experts):
            parts = tensor[expert].split(inter) if len(projections) == 2 else (tensor[expert],)
            for projection, part in zip(projections, parts, strict=True):
                yield f"{block}.experts.{expert}.{projection}.weight", part
