"""ERNIE 4.5 MoE (Baidu ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B, base and post-trained): ERNIE
4.5 dense's layers with a mixture of experts and shared experts in some of them.

As HF transformers' ``Ernie4_5_Moe`` code defines it, what differs from Llama:

- **Attention**: ERNIE 4.5 dense's (:mod:`.ernie4_5`): RoPE on interleaved pairs
  ``(2i, 2i + 1)`` computed in float32, ``use_bias`` on q, k, v and o; ``head_dim`` is
  ``hidden_size / num_attention_heads`` unless the config names one.
- **Which layers are sparse**: layer ``i`` is when ``(i + 1) % moe_layer_interval == 0`` and
  ``moe_layer_start_index <= i <= moe_layer_end_index`` (``-1``: the last layer); the others
  have a dense SwiGLU MLP of ``intermediate_size``.
- **Sparse layers** (:class:`Ernie4_5_MoeBlock`): the router ``gate`` (a bias-free float32
  weight, applied in float32) takes a softmax over the ``moe_num_experts`` experts; the
  ``moe_k`` experts are *chosen* by the softmax plus ``moe_statics.e_score_correction_bias``
  (a float32 per-expert bias, used only to choose), and *weighted* by their unbiased
  probabilities divided by their sum (at least ``moe_norm_min``), rounded to the model dtype.
  Each expert is a bias-free SwiGLU MLP of ``moe_intermediate_size``;
  ``shared_experts``, one SwiGLU MLP of ``moe_num_shared_experts * moe_intermediate_size``
  (biases by ``use_bias``), sees every token, ungated.
- ``use_bias`` puts biases on every dense projection (attention, dense MLPs, shared experts)
  and on the LM head too (HF's ERNIE 4.5 MoE head has ``bias=use_bias``; the dense model's
  has none); the head is tied to the embedding unless ``tie_word_embeddings`` is false.
- The checkpoints' multi-token-prediction tensors (``mtp*``) are not read (HF ignores them
  too).

Checkpoint names: ``mlp.gate.weight``, ``mlp.moe_statics.e_score_correction_bias`` (``[1,
E]``; HF's in-memory ``mlp.gate.moe_statics.`` is read as well),
``mlp.experts.<e>.{gate,up,down}_proj.weight``, ``mlp.shared_experts.*``.

Tensor parallel as the other MoE models: heads and KV heads split (Llama's), each expert's,
the shared experts' and the dense MLPs' intermediate columns split (or whole experts per
rank with ``--enable-expert-parallel``), the router and its correction bias whole on every
rank, the head's bias split by vocabulary rows as the head is.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chassis.builtin_plugins.models.deepseek_v2 import RoutedExperts
from chassis.builtin_plugins.models.ernie4_5 import Ernie4_5ForCausalLM
from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaMLP
from chassis.builtin_plugins.models.sparse_moe import MoeSpec, SparseMoeForCausalLM
from chassis.core import parallel_state
from chassis.core.layers.vocab_parallel import vocab_shard
from chassis.core.model_interface import ModelBuildContext

#: HF's ``_keys_to_ignore_on_load_unexpected = ["mtp"]``: the multi-token-prediction tensors
_MTP = re.compile(r"(^|\.)mtp")


def _config_int(hf_config: Any, field: str, default: int, minimum: int) -> int:
    value = getattr(hf_config, field, None)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(
            f"config {field} {value!r} is not supported for ERNIE 4.5 MoE (only an integer "
            f">= {minimum}, one value for every layer)"
        )
    return value


class Ernie4_5_MoeStatics(nn.Module):
    """``e_score_correction_bias [1, E]`` float32 (HF's ``moe_statics``; one group)."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.e_score_correction_bias = nn.Parameter(
            torch.empty(1, num_experts, dtype=torch.float32), requires_grad=False
        )


class Ernie4_5_MoeRouter(nn.Module):
    """HF's ``Ernie4_5_MoeTopKRouter`` (the module docstring): ``weight [E, hidden]``
    float32. ``forward(x, correction [1, E]) -> (weights [T, k] in x's dtype, ids [T, k])``."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, norm_min: float) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_min = norm_min
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False
        )

    def forward(
        self, x: torch.Tensor, correction: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        ids = torch.topk(probs + correction.float().squeeze(0), self.top_k, dim=-1)[1]
        weights = probs.gather(-1, ids)
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min)
        return weights.to(x.dtype), ids


class Ernie4_5_MoeBlock(nn.Module):
    """Router ``gate``, its ``moe_statics``, routed ``experts`` and ungated
    ``shared_experts``: ``forward(x [T, hidden]) -> [T, hidden]``, summed over the
    tensor-parallel group."""

    def __init__(self, spec: DecoderSpec, moe: MoeSpec, norm_min: float) -> None:
        super().__init__()
        self.gate = Ernie4_5_MoeRouter(moe.num_experts, moe.top_k, spec.hidden_size, norm_min)
        self.moe_statics = Ernie4_5_MoeStatics(moe.num_experts)
        self.experts = RoutedExperts(
            moe.num_experts,
            moe.top_k,
            spec.hidden_size,
            moe.intermediate_size,
            renormalize=True,  # the router does it (unused: it routes itself)
            round_weights_to_model_dtype=True,  # the router does it
        )
        self.shared_experts: LlamaMLP | None = None
        if moe.shared_expert_intermediate_size:
            _, share = parallel_state.shard(
                moe.shared_expert_intermediate_size,
                "moe_num_shared_experts * moe_intermediate_size",
            )
            # spec.mlp_bias: use_bias, which HF's shared experts take too
            self.shared_experts = LlamaMLP(spec, share, reduce_output=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, self.moe_statics.e_score_correction_bias)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        # Each rank holds some intermediate columns (or whole experts): partial sums add up.
        return parallel_state.all_reduce(out)


class Ernie4_5_MoeForCausalLM(SparseMoeForCausalLM, Ernie4_5ForCausalLM):
    """``Ernie4_5_MoeForCausalLM`` checkpoints (baidu/ERNIE-4.5-21B-A3B-PT/-Base-PT,
    ERNIE-4.5-300B-A47B-PT/-Base-PT; the module docstring).

    Refused at build, with a ``ValueError`` naming the field: what ERNIE 4.5 dense refuses
    (a ``hidden_act`` other than ``silu``, a RoPE type the rotary tables lack, a
    ``partial_rotary_factor`` below 1) and MoE fields that are not one integer for every
    layer (the VL models' per-modality lists of ``moe_num_experts``, ``moe_k``,
    ``moe_layer_start_index``, ...), or out of range.
    """

    checkpoint_renames = (("mlp.gate.moe_statics.", "mlp.moe_statics."),)

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        #: the routing and layer layout, checked before anything is built
        self.moe = self.moe_spec(hf_config)
        self.moe_layers = self.sparse_layers(hf_config)
        self.norm_min = float(getattr(hf_config, "moe_norm_min", None) or 1e-12)
        super().__init__(hf_config, build_ctx)

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoeSpec:
        num_experts = _config_int(hf_config, "moe_num_experts", 64, 1)
        top_k = _config_int(hf_config, "moe_k", 6, 1)
        if top_k > num_experts:
            raise ValueError(f"config moe_k {top_k} must be in [1, {num_experts}]")
        inter = _config_int(hf_config, "moe_intermediate_size", 1536, 1)
        shared = _config_int(hf_config, "moe_num_shared_experts", 2, 0)
        return MoeSpec(
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=inter,
            renormalize=True,
            round_weights_to_model_dtype=True,
            shared_expert_intermediate_size=shared * inter,
        )

    @classmethod
    def sparse_layers(cls, hf_config: Any) -> frozenset[int]:
        """The layers with a MoE block (the module docstring's rule)."""
        num_layers = int(hf_config.num_hidden_layers)
        start = _config_int(hf_config, "moe_layer_start_index", 1, 0)
        end = _config_int(hf_config, "moe_layer_end_index", -1, -1)
        if end == -1:
            end = num_layers - 1
        interval = _config_int(hf_config, "moe_layer_interval", 1, 1)
        return frozenset(
            i for i in range(num_layers) if (i + 1) % interval == 0 and start <= i <= end
        )

    def make_mlp(self, layer_idx: int) -> nn.Module:
        if layer_idx in self.moe_layers:
            return Ernie4_5_MoeBlock(self.spec, self.moe, self.norm_min)
        return LlamaMLP(self.spec)

    def build_head(self, hf_config: Any) -> None:
        """Llama's head, with a bias (this rank's vocabulary rows) when ``use_bias``."""
        super().build_head(hf_config)
        if bool(getattr(hf_config, "use_bias", False)):
            _, rows = vocab_shard(self.vocab_size)
            self.lm_head.bias = nn.Parameter(torch.empty(rows), requires_grad=False)

    def needs_checkpoint_tensor(self, name: str) -> bool:
        """Not the multi-token-prediction tensors, nor other ranks' experts."""
        return _MTP.search(name) is None and super().needs_checkpoint_tensor(name)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As :meth:`SparseMoeForCausalLM.load_weights`, the ``mtp*`` tensors skipped."""
        return super().load_weights((n, t) for n, t in weights if _MTP.search(n) is None)

    def _tensor_parallel_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Llama's cuts, and the head's bias cut by vocabulary rows (zeros past the
        vocabulary) as the head's weight is."""
        if name != "lm_head.bias" or parallel_state.tp_size() == 1:
            return super()._tensor_parallel_slice(name, tensor)
        if tensor.shape[0] != self.vocab_size:
            raise ValueError(
                f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, expected the "
                f"vocabulary's {self.vocab_size} (does config.json match the weights?)"
            )
        start, rows = vocab_shard(self.vocab_size)
        part = tensor[start : start + rows]
        if part.shape[0] < rows:
            part = torch.cat([part, part.new_zeros(rows - part.shape[0])])
        return part
