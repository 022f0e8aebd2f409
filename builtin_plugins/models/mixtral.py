"""Mixtral: the Mistral decoder with a sparse MoE block (top-2 of 8 experts) in every layer."""

from __future__ import annotations

from typing import Any

from chassis.builtin_plugins.models.sparse_moe import MoeSpec, SparseMoeForCausalLM


class MixtralForCausalLM(SparseMoeForCausalLM):
    """``MixtralForCausalLM`` checkpoints.

    The checkpoint calls the block ``block_sparse_moe`` and the experts' projections
    ``w1`` (gate), ``w3`` (up) and ``w2`` (down). The top-k routing weights are always
    renormalized and stay float32 (as in HF transformers).
    """

    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoeSpec:
        return MoeSpec(
            num_experts=int(hf_config.num_local_experts),
            top_k=int(hf_config.num_experts_per_tok),
            intermediate_size=int(hf_config.intermediate_size),
            renormalize=True,
            round_weights_to_model_dtype=False,
            intermediate_size_field="intermediate_size",
        )
