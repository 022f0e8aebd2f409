"""Mixture-of-experts decoders: the Llama decoder with sparse MoE blocks as MLPs.

:class:`SparseMoeForCausalLM` is the base of Mixtral, Qwen2-MoE and Qwen3-MoE. Each of its
sparse layers holds a :class:`SparseMoeBlock` (router, experts, optional shared expert) in
place of the SwiGLU MLP; the attention is the Llama/Qwen one. Subclasses describe their
architecture with :meth:`SparseMoeForCausalLM.moe_spec` and, where the checkpoint names
differ, :attr:`SparseMoeForCausalLM.checkpoint_renames`.

Tensor parallel: every rank holds all experts, each with ``1/N`` of its intermediate
columns (like the dense MLP), and the router whole; the block all-reduces once. With expert
parallelism (``--enable-expert-parallel``) each rank holds whole experts instead, a
contiguous range (:func:`chassis.core.parallel_state.expert_split`), and reads only their
checkpoint tensors (:meth:`SparseMoeForCausalLM.needs_checkpoint_tensor`); the router stays
whole and Qwen2-MoE's shared expert stays split by columns, as vLLM keeps it, so one
all-reduce still sums everything.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaForCausalLM, LlamaMLP
from chassis.core import parallel_state
from chassis.core.layers.moe import FusedMoE

#: ``<prefix>.mlp.experts.<index>.<projection>.weight`` in a checkpoint (after renames)
_EXPERT_TENSOR = re.compile(
    r"^(?P<block>.+\.mlp)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$"
)
#: any tensor of one expert (a weight, or an FP8 scale beside it), after renames
_ANY_EXPERT_TENSOR = re.compile(r"^(?P<block>.+\.mlp)\.experts\.(?P<expert>\d+)\.")
#: a checkpoint's expert projection name -> FusedMoE's (Qwen's names, then Mixtral's)
_EXPERT_PROJECTIONS = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
}


@dataclass(frozen=True)
class MoeSpec:
    """The sparse blocks of one architecture, read from its HF config."""

    num_experts: int
    top_k: int
    #: each expert's intermediate size (whole, not this rank's share)
    intermediate_size: int
    renormalize: bool
    round_weights_to_model_dtype: bool
    #: layers with a dense MLP instead (Qwen's ``mlp_only_layers``)
    dense_layers: frozenset[int] = frozenset()
    #: every ``sparse_step``-th layer is sparse (Qwen's ``decoder_sparse_step``)
    sparse_step: int = 1
    #: a gated, always-on shared expert of this intermediate size (Qwen2-MoE); 0 for none
    shared_expert_intermediate_size: int = 0
    #: the config field ``intermediate_size`` comes from (for error messages)
    intermediate_size_field: str = "moe_intermediate_size"

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` holds a MoE block (else a dense MLP)."""
        return (
            self.num_experts > 0
            and layer_idx not in self.dense_layers
            and (layer_idx + 1) % self.sparse_step == 0
        )


class SparseMoeBlock(nn.Module):
    """Router (``gate``), ``experts`` and optionally a sigmoid-gated ``shared_expert``.

    ``forward(x [T, hidden]) -> [T, hidden]``, summed over the tensor-parallel group. The
    module names are HF's (``gate``, ``experts``, ``shared_expert``, ``shared_expert_gate``),
    so checkpoint names map onto them directly.
    """

    def __init__(self, spec: DecoderSpec, moe: MoeSpec) -> None:
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
        self.shared_expert: LlamaMLP | None = None
        if moe.shared_expert_intermediate_size:
            _, shared_share = parallel_state.shard(
                moe.shared_expert_intermediate_size, "shared_expert_intermediate_size"
            )
            self.shared_expert = LlamaMLP(spec, shared_share, reduce_output=False)
            self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            out = out + shared
        # Each rank holds some intermediate columns of every expert: partial sums add up.
        return parallel_state.all_reduce(out)


class SparseMoeForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose sparse layers are :class:`SparseMoeBlock` s.

    Subclasses implement :meth:`moe_spec` (and :meth:`decoder_spec` for the attention
    options). ``load_weights`` routes each expert's checkpoint matrices into the stacked
    expert weights and everything else through :meth:`LlamaForCausalLM.load_weights`.
    """

    #: (checkpoint substring, ours) applied to every checkpoint name before it is matched
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoeSpec:
        """The sparse-block options of this architecture (subclasses implement it)."""
        raise NotImplementedError

    def needs_checkpoint_tensor(self, name: str) -> bool:
        """Every tensor but those of experts another rank holds (expert parallelism)."""
        for old, new in self.checkpoint_renames:
            name = name.replace(old, new)
        match = _ANY_EXPERT_TENSOR.match(name)
        if match is None:
            return True
        try:
            experts = self.get_submodule(f"{match['block']}.experts")
        except AttributeError:
            return True  # no such block: loading it raises the error that names it
        return not isinstance(experts, FusedMoE) or _held_or_unknown(experts, match["expert"])

    def make_mlp(self, layer_idx: int) -> nn.Module:
        moe = self.moe_spec(self.hf_config)
        if moe.is_sparse(layer_idx):
            return SparseMoeBlock(self.spec, moe)
        return LlamaMLP(self.spec)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As :meth:`LlamaForCausalLM.load_weights`, plus each expert's
        ``experts.<e>.{gate_proj,up_proj,down_proj}`` (or Mixtral's ``w1``/``w3``/``w2``)
        copied into its block's stacked ``w13``/``w2``; those count as filled once the three
        matrices of every expert this rank holds arrived (another rank's experts, when
        given, are passed over)."""
        modules = dict(self.named_modules())
        expert_shards: dict[str, set[str]] = {}

        def dense_tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                for old, new in self.checkpoint_renames:
                    name = name.replace(old, new)
                match = _EXPERT_TENSOR.match(name)
                if match is None:
                    yield name, tensor
                    continue
                experts = modules.get(f"{match['block']}.experts")
                projection = _EXPERT_PROJECTIONS.get(match["proj"])
                if not isinstance(experts, FusedMoE) or projection is None:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has no counterpart in "
                        f"{type(self).__name__}; is the checkpoint's architecture right?"
                    )
                if not _held_or_unknown(experts, match["expert"]):
                    continue  # another rank's (expert parallelism)
                key = experts.load_expert_weight(int(match["expert"]), projection, tensor)
                expert_shards.setdefault(match["block"], set()).add(key)

        filled = super().load_weights(dense_tensors())
        # every block, also one that got nothing: a rank may hold no expert (fewer experts
        # than ranks), and its empty stacks are then complete
        for name, experts in modules.items():
            if isinstance(experts, FusedMoE):
                block = name.removesuffix(".experts")
                if expert_shards.get(block, set()) >= experts.shards_needed():
                    filled |= {f"{name}.w13", f"{name}.w2"}
        return filled


def _held_or_unknown(experts: FusedMoE, expert: str) -> bool:
    """Whether expert ``expert`` (a checkpoint's index) is this rank's to load, or no expert
    at all (then loading it raises the error that names it)."""
    index = int(expert)
    return experts.holds_expert(index) or not 0 <= index < experts.num_experts


def qwen_moe_spec(hf_config: Any, shared_expert: bool) -> MoeSpec:
    """The Qwen2-MoE / Qwen3-MoE config fields (``num_experts``, ``moe_intermediate_size``,
    ``norm_topk_prob``, ``mlp_only_layers``, ``decoder_sparse_step``)."""
    num_experts = getattr(hf_config, "num_experts", None)
    if num_experts is None:
        num_experts = hf_config.num_local_experts
    return MoeSpec(
        num_experts=int(num_experts),
        top_k=int(hf_config.num_experts_per_tok),
        intermediate_size=int(hf_config.moe_intermediate_size),
        renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
        round_weights_to_model_dtype=True,
        dense_layers=frozenset(int(i) for i in getattr(hf_config, "mlp_only_layers", None) or ()),
        sparse_step=int(getattr(hf_config, "decoder_sparse_step", 1) or 1),
        shared_expert_intermediate_size=(
            int(hf_config.shared_expert_intermediate_size) if shared_expert else 0
        ),
    )
