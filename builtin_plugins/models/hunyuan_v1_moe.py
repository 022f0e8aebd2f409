"""Hunyuan MoE (Tencent Hunyuan-A13B, base and instruct): Hunyuan dense's attention with a
mixture of experts and an always-on shared MLP in every layer.

As HF transformers' ``HunYuanMoEV1`` code defines it, what differs from Llama:

- **Attention**: Hunyuan dense's (:mod:`.hunyuan_v1_dense`): per-head
  ``query_layernorm``/``key_layernorm`` RMSNorms applied *after* RoPE, the checkpoints'
  ``{"type": "dynamic", "alpha": A}`` RoPE read as a fixed NTK-alpha base change, and
  ``attention_bias`` on q, k, v and o.
- **MLP**: every layer is sparse (:class:`HunYuanMoeBlock`): a router ``gate.wg`` (a
  bias-free float32 weight, applied in float32) takes a softmax over the ``num_experts``
  experts, keeps the ``moe_topk`` best (an int, or one per layer) and divides them by their
  sum; each expert is a SwiGLU MLP of ``intermediate_size`` (HF's experts read that field,
  not ``moe_intermediate_size``); ``shared_mlp``, one more SwiGLU MLP of
  ``intermediate_size``, sees every token, ungated, and is added to the experts' weighted
  sum. No MLP biases.

Checkpoint names: the released checkpoints' and HF's saved ones are alike:
``mlp.gate.wg.weight``, ``mlp.experts.<e>.{gate,up,down}_proj.weight``,
``mlp.shared_mlp.{gate,up,down}_proj.weight``.

Tensor parallel as the other MoE models: heads and KV heads split (Llama's), each expert's
and the shared MLP's intermediate columns split (or whole experts per rank with
``--enable-expert-parallel``), the per-head norms and the router whole on every rank; one
all-reduce per block.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chassis.builtin_plugins.models.deepseek_v2 import RoutedExperts
from chassis.builtin_plugins.models.hunyuan_v1_dense import HunYuanDenseV1ForCausalLM
from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaMLP
from chassis.builtin_plugins.models.sparse_moe import MoeSpec, SparseMoeForCausalLM
from chassis.core import parallel_state


def _per_layer(hf_config: Any, field: str, num_layers: int) -> list[Any] | None:
    """``field`` as one value per layer (an int repeated, or the config's list), ``None``
    when the config lacks it; a list of the wrong length is a ``ValueError``."""
    value = getattr(hf_config, field, None)
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if len(value) != num_layers:
            raise ValueError(
                f"config {field} has {len(value)} entries, expected one per layer "
                f"(num_hidden_layers {num_layers})"
            )
        return list(value)
    return [value] * num_layers


class HunYuanRouterWeight(nn.Module):
    """The router's ``wg``: a float32 ``weight [E, hidden]`` (a plain module, not an
    ``nn.Linear``, so no platform swaps it for a model-dtype kernel)."""

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False
        )


class HunYuanRouter(nn.Module):
    """HF's ``HunYuanMoEV1Gate``: ``forward(x) -> (weights float32 [T, k], ids [T, k])``,
    the softmax over all experts in float32, its top ``top_k`` divided by their sum."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.wg = HunYuanRouterWeight(num_experts, hidden_size)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.wg.weight.float())
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), ids


class HunYuanMoeBlock(nn.Module):
    """Router ``gate``, routed ``experts`` and the ungated ``shared_mlp`` (HF's names):
    ``forward(x [T, hidden]) -> [T, hidden]``, summed over the tensor-parallel group."""

    def __init__(self, spec: DecoderSpec, moe: MoeSpec) -> None:
        super().__init__()
        self.gate = HunYuanRouter(moe.num_experts, moe.top_k, spec.hidden_size)
        self.experts = RoutedExperts(
            moe.num_experts,
            moe.top_k,
            spec.hidden_size,
            moe.intermediate_size,
            renormalize=True,  # the router does it (unused: it routes itself)
            round_weights_to_model_dtype=False,  # HF scales the experts' outputs in float32
            intermediate_size_field=moe.intermediate_size_field,
        )
        _, share = parallel_state.shard(moe.shared_expert_intermediate_size, "intermediate_size")
        self.shared_mlp = LlamaMLP(spec, share, reduce_output=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids) + self.shared_mlp(x)
        # Each rank holds some intermediate columns (or whole experts): partial sums add up.
        return parallel_state.all_reduce(out)


class HunYuanMoEV1ForCausalLM(SparseMoeForCausalLM, HunYuanDenseV1ForCausalLM):
    """``HunYuanMoEV1ForCausalLM`` checkpoints (tencent/Hunyuan-A13B-Pretrain and -Instruct;
    the module docstring).

    Refused at build, with a ``ValueError`` naming the field: everything Hunyuan dense
    refuses (a ``hidden_act`` other than ``silu``, a RoPE type the rotary tables lack,
    ``dynamic`` without ``alpha``, ``partial_rotary_factor`` below 1, ``use_qk_norm`` false,
    ``use_cla`` true, ``use_rotary_pos_emb`` false), and the original configs' MoE fields
    where they describe a model HF's code does not build: ``num_experts`` per layer (a
    list), ``use_mixed_mlp_moe`` false (HF always adds the shared MLP),
    ``num_shared_expert`` other than 1 and ``moe_intermediate_size`` other than
    ``intermediate_size`` (HF sizes experts and shared MLP by ``intermediate_size``).
    """

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        cls.check_moe_config(hf_config)
        return super().decoder_spec(hf_config)

    @classmethod
    def check_moe_config(cls, hf_config: Any) -> None:
        """The ``ValueError`` s of the class docstring (MoE fields)."""
        num_layers = int(hf_config.num_hidden_layers)
        num_experts = getattr(hf_config, "num_experts", None)
        if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
            raise ValueError(
                f"config num_experts {num_experts!r} is not supported for Hunyuan MoE (only "
                "one positive number of experts for every layer, as HF's HunYuanMoEV1 builds)"
            )
        for k in _per_layer(hf_config, "moe_topk", num_layers) or [1]:
            if not isinstance(k, int) or isinstance(k, bool) or not 0 < k <= num_experts:
                raise ValueError(f"config moe_topk {k!r} must be in [1, {num_experts}]")
        mixed = getattr(hf_config, "use_mixed_mlp_moe", None)
        if mixed is not None and not mixed:
            raise ValueError(
                "config use_mixed_mlp_moe False is not supported for Hunyuan MoE (HF's "
                "HunYuanMoEV1 always adds the shared MLP)"
            )
        for shared in _per_layer(hf_config, "num_shared_expert", num_layers) or ():
            if shared != 1:
                raise ValueError(
                    f"config num_shared_expert {shared!r} is not supported for Hunyuan MoE "
                    "(HF's HunYuanMoEV1 builds exactly one shared MLP)"
                )
        inter = int(hf_config.intermediate_size)
        for moe_inter in _per_layer(hf_config, "moe_intermediate_size", num_layers) or ():
            if moe_inter != inter:
                raise ValueError(
                    f"config moe_intermediate_size {moe_inter!r} is not supported for Hunyuan "
                    f"MoE unless it equals intermediate_size {inter} (HF's HunYuanMoEV1 sizes "
                    "the experts by intermediate_size)"
                )

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int = 0) -> MoeSpec:
        """Layer ``layer_idx``'s block: ``moe_topk`` may differ per layer."""
        num_layers = int(hf_config.num_hidden_layers)
        top_k = (_per_layer(hf_config, "moe_topk", num_layers) or [1] * num_layers)[layer_idx]
        inter = int(hf_config.intermediate_size)
        return MoeSpec(
            num_experts=int(hf_config.num_experts),
            top_k=int(top_k),
            intermediate_size=inter,
            renormalize=True,
            round_weights_to_model_dtype=False,
            shared_expert_intermediate_size=inter,
            intermediate_size_field="intermediate_size",
        )

    def make_mlp(self, layer_idx: int) -> nn.Module:
        return HunYuanMoeBlock(self.spec, self.moe_spec(self.hf_config, layer_idx))
