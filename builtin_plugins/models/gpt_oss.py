"""gpt-oss (OpenAI gpt-oss-20b / gpt-oss-120b): attention sinks, alternating windows, and
mixture-of-experts blocks with biases and a clamped SwiGLU.

As HF transformers' ``GptOss`` code defines it, a layer is Llama's pre-norm layout::

    h = h + attn(input_layernorm(h))
    h = h + moe(post_attention_layernorm(h))

with these differences:

- **attention**: biases on q, k, v and o; a learned logit per query head (``sinks``) joins
  every softmax denominator (it takes probability mass and contributes no value; the
  attention backend applies it, so it needs one with ``supports_attention_sinks``); the
  layers ``layer_types`` marks ``sliding_attention`` (by default every other one, from the
  first) see the last ``sliding_window`` (128) positions; RoPE is YaRN-scaled
  (``core/layers/rotary.py``).
- **router**: a linear layer with a bias; each token takes the ``num_experts_per_tok``
  largest logits and a softmax over just those.
- **experts**: ``gate_up = x @ W_gu + b_gu`` with gate and up *interleaved* in the
  checkpoint (columns ``0::2`` gate, ``1::2`` up), then
  ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
  ``h = (up + 1) * gate * sigmoid(alpha * gate)``, and ``h @ W_d + b_d``
  (``alpha = swiglu_alpha`` 1.702, ``limit = swiglu_limit`` 7). The checkpoint stores
  ``gate_up_proj [E, hidden, 2I]`` and ``down_proj [E, I, hidden]`` (input-major); they are
  loaded de-interleaved and transposed into :class:`GptOssExperts`' ``w13 [E, 2I, hidden]``
  (each expert's gate rows, then its up rows) and ``w2 [E, hidden, I]``. The released
  checkpoints store the experts in MXFP4, dequantized at load
  (``core/quantized_weights.py``).
- **norms**: RMSNorm with the scale applied in float32 before the cast back (HF keeps the
  norms in float32), :class:`GptOssRMSNorm`.

The experts run the platform's ``fused_moe_clamped_swiglu`` kernel when it offers one for
their weights (CUDA/ROCm: the Triton fused MoE, ``core/layers/triton_moe.py``), which reads
nothing back to the host, so decode steps are captured as device graphs. Otherwise (the CPU,
``CHASSIS_LAYER_KERNELS=0``, ``torch.compile``) they run :func:`experts_reference`, the torch
path the kernel is tested against (tokens sorted by expert, one matmul pair per expert
used), which reads the expert counts on the host: then decode steps stay eager
(:meth:`GptOssExperts.graph_capture_blocker`).

Tensor parallel: attention heads (and their sinks) split as Llama's; every rank holds all
experts with ``1/N`` of their intermediate columns (gate/up rows and biases, down columns;
the down bias is added by rank 0 only) and the router whole; the block all-reduces once.
With expert parallelism (``--enable-expert-parallel``) each rank holds whole experts, a
contiguous range (:func:`chassis.core.parallel_state.expert_split`), with their biases: a
token's down bias then comes from the rank of the expert it chose, so every rank adds the
biases of its own experts. The checkpoint stacks all experts in one tensor, so each rank
reads the stack and keeps its rows.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chassis.builtin_plugins.models.llama import (
    DecoderSpec,
    LlamaForCausalLM,
    qwen_sliding_layers,
)
from chassis.core import parallel_state
from chassis.core.layers.kernels import kernels_for
from chassis.core.layers.moe import localize_expert_ids, run_experts_grouped
from chassis.core.layers.norm import RMSNorm

#: ``<block>.experts.<tensor>`` in a checkpoint: the experts' stacked weights and biases
_EXPERT_TENSOR = re.compile(
    r"^(?P<block>.+\.mlp)\.experts\.(?P<tensor>gate_up_proj|gate_up_proj_bias|down_proj|"
    r"down_proj_bias)$"
)


class GptOssRMSNorm(RMSNorm):
    """RMSNorm as HF's ``GptOssRMSNorm``: ``(weight * x * rsqrt(mean(x^2) + eps))`` all in
    float32, cast to the input dtype once (HF keeps these weights in float32; the
    checkpoint's values are the same). Float32 results equal :class:`RMSNorm`'s; 16-bit
    ones round once instead of twice. Always the torch code (the platforms' ``rms_norm``
    kernels round as :class:`RMSNorm` does)."""

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.forward_reference(x, residual)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of ``gate_up [T, 2I]`` (gate columns, then up columns) -> ``[T, I]``:
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``,
    in the input dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def experts_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    b13: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """gpt-oss's experts in torch: ``sum_j weights[:, j] * expert_{ids[:, j]}(x)``, ``[T, H]``
    in ``x``'s dtype, with ``expert_e(x) = clamped_swiglu(x @ w13[e].T + b13[e]) @ w2[e].T +
    b2[e]``.

    Each expert's output is computed in the model dtype (as HF does), the weighted sum over a
    token's experts in float32, rounded once. Tokens are sorted by expert and each expert
    that any token chose runs once over its rows; the counts are read on the host. The
    reference of the platforms' ``fused_moe_clamped_swiglu`` kernels (same arguments). An id
    of ``-1`` (the expert is on another rank) leaves its pair out, bias included.
    """

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        hidden = clamped_swiglu(F.linear(rows, w13[e], b13[e]), alpha, limit)
        return F.linear(hidden, w2[e], b2[e])

    return run_experts_grouped(x, weights, ids, w13.shape[0], expert)


class GptOssExperts(nn.Module):
    """The experts of one gpt-oss block: ``forward(x [T, H], weights [T, k], ids [T, k])``
    returns ``sum_j weights[:, j] * expert_{ids[:, j]}(x)`` (``[T, H]``, this rank's partial
    sum under tensor or expert parallelism: the caller all-reduces). ``ids`` are global
    expert ids; under expert parallelism this rank holds the experts
    ``[expert_start, expert_start + num_local_experts)`` whole and leaves out the pairs
    routed to the others.

    ``expert_e(x) = clamped_swiglu(x @ w13[e].T + b13[e]) @ w2[e].T + b2[e]``. Runs the
    platform's ``fused_moe_clamped_swiglu`` kernel when the platform offers one for the
    weights (no host read: decode steps can be captured as graphs), else
    :meth:`forward_reference` (:func:`experts_reference`, which reads the expert counts on
    the host). Rounding as :func:`experts_reference` says.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        alpha: float,
        limit: float,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.alpha = alpha
        self.limit = limit
        #: the checkpoint's intermediate size, and this rank's share of it (all of it under
        #: expert parallelism)
        self.full_intermediate_size = intermediate_size
        #: the experts this rank holds: global ids ``[expert_start, expert_start + n)``
        self.expert_start, local = parallel_state.shard_experts(num_experts)
        self.num_local_experts = local
        self.shard_start, inter = parallel_state.shard_expert_columns(
            intermediate_size, "intermediate_size"
        )
        self.intermediate_size = inter

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape), requires_grad=False)

        self.w13 = param(local, 2 * inter, hidden_size)
        self.b13 = param(local, 2 * inter)
        self.w2 = param(local, hidden_size, inter)
        self.b2 = param(local, hidden_size)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.num_local_experts != self.num_experts:
            ids = localize_expert_ids(ids, self.expert_start, self.num_local_experts)
        fused = self._kernel()
        if fused is not None:
            args = (self.w13, self.b13, self.w2, self.b2, weights, ids, self.alpha, self.limit)
            return fused(x, *args)
        return self.forward_reference(x, weights, ids)

    def forward_reference(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """The torch path (:func:`experts_reference`), whatever the platform offers; ``ids``
        are this rank's local ids (``-1``: another rank's expert)."""
        return experts_reference(
            x, self.w13, self.b13, self.w2, self.b2, weights, ids, self.alpha, self.limit
        )

    def _kernel(self) -> Any:
        """The platform's ``fused_moe_clamped_swiglu`` for these weights, or ``None``."""
        kernels = kernels_for(self.w13)
        return getattr(kernels, "fused_moe_clamped_swiglu", None) if kernels is not None else None

    def graph_capture_blocker(self) -> str | None:
        """``None`` when the platform's kernel runs the experts; else why a forward cannot
        be captured: the torch path reads the experts' token counts on the host (see
        :meth:`chassis.core.model_interface.CausalLM.graph_capture_blocker`)."""
        if self._kernel() is not None:
            return None
        return (
            "gpt-oss's experts (biases, clamped SwiGLU) run a torch path that reads expert "
            "counts on the host (the platform offers no fused_moe_clamped_swiglu kernel for "
            f"{self.w13.dtype} on {self.w13.device.type})"
        )

    @torch.no_grad()
    def load(self, tensor_name: str, tensor: torch.Tensor) -> str:
        """Copy one checkpoint tensor in (this rank's share of it): ``gate_up_proj``
        ``[E, H, 2I]`` and ``gate_up_proj_bias [E, 2I]`` (gate and up interleaved),
        ``down_proj [E, I, H]``, ``down_proj_bias [E, H]``: the rows of the experts this
        rank holds, and of those this rank's intermediate columns. Returns the parameter
        filled; a wrong shape is a ``ValueError``."""
        num_experts, hidden = self.num_experts, self.w13.shape[2]
        full, start, size = self.full_intermediate_size, self.shard_start, self.intermediate_size
        expected = {
            "gate_up_proj": (num_experts, hidden, 2 * full),
            "gate_up_proj_bias": (num_experts, 2 * full),
            "down_proj": (num_experts, full, hidden),
            "down_proj_bias": (num_experts, hidden),
        }[tensor_name]
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"experts.{tensor_name} has shape {tuple(tensor.shape)}, expected {expected} "
                "(does config.json match the weights?)"
            )
        tensor = tensor[self.expert_start : self.expert_start + self.num_local_experts]
        if tensor_name.startswith("gate_up_proj"):
            # [..., 2I] interleaved (gate 0::2, up 1::2) -> this rank's gate, then its up
            gate = tensor[..., 0::2][..., start : start + size]
            up = tensor[..., 1::2][..., start : start + size]
            merged = torch.cat([gate, up], dim=-1)
            if tensor_name == "gate_up_proj":
                self.w13.data.copy_(merged.transpose(1, 2))
                return "w13"
            self.b13.data.copy_(merged)
            return "b13"
        if tensor_name == "down_proj":
            self.w2.data.copy_(tensor[:, start : start + size].transpose(1, 2))
            return "w2"
        # every rank's partial sums add up: the bias joins only one of them (under expert
        # parallelism, the one of the rank that holds the expert, so every rank keeps its own)
        keep = parallel_state.expert_parallel() or parallel_state.tp_rank() == 0
        self.b2.data.copy_(tensor if keep else torch.zeros_like(tensor))
        return "b2"


class GptOssMoE(nn.Module):
    """``router`` (linear with a bias) and ``experts`` (HF's ``mlp.*`` names).

    ``forward(x [T, H]) -> [T, H]``, summed over the tensor-parallel group. Routing as HF:
    the ``top_k`` largest logits (``torch.topk``), softmax over them in float32, rounded to
    the model dtype.
    """

    def __init__(self, hf_config: Any, hidden_size: int) -> None:
        super().__init__()
        num_experts = int(hf_config.num_local_experts)
        self.top_k = int(hf_config.num_experts_per_tok)
        if not 0 < self.top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.top_k} must be in [1, {num_experts}] "
                "(num_local_experts)"
            )
        self.router = nn.Linear(hidden_size, num_experts, bias=True)
        self.experts = GptOssExperts(
            num_experts,
            hidden_size,
            int(hf_config.intermediate_size),
            float(getattr(hf_config, "swiglu_alpha", 1.702)),
            float(getattr(hf_config, "swiglu_limit", 7.0)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        top_logits, ids = torch.topk(logits, self.top_k, dim=-1)
        weights = torch.softmax(top_logits.float(), dim=-1).to(x.dtype)
        # Each rank holds some intermediate columns of every expert: partial sums add up.
        return parallel_state.all_reduce(self.experts(x, weights, ids))


class GptOssForCausalLM(LlamaForCausalLM):
    """``GptOssForCausalLM`` checkpoints (openai/gpt-oss-20b, openai/gpt-oss-120b), bf16 or
    MXFP4 experts.

    The decoder is Llama's (:class:`LlamaForCausalLM`) with attention sinks
    (``DecoderSpec.attention_sinks``), :class:`GptOssRMSNorm` norms and a :class:`GptOssMoE`
    block as every layer's MLP. Attention projections, sinks, embeddings and LM head load as
    :class:`LlamaForCausalLM`'s (q/k/v merged, tensor-parallel cuts: the sinks by query
    head); the experts' stacked tensors go to :meth:`GptOssExperts.load`.
    """

    norm_class = GptOssRMSNorm

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        """Attention biases per ``attention_bias`` (gpt-oss: on), sinks, the window on the
        layers ``layer_types`` marks ``sliding_attention`` (without it: every other layer,
        from the first, as HF's default)."""
        bias = bool(getattr(hf_config, "attention_bias", True))
        return DecoderSpec.from_config(
            hf_config,
            qkv_bias=bias,
            o_bias=bias,
            sliding_layers=qwen_sliding_layers(hf_config, lambda i: i % 2 == 0),
            attention_sinks=True,
        )

    def make_mlp(self, layer_idx: int) -> nn.Module:
        return GptOssMoE(self.hf_config, self.spec.hidden_size)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As :meth:`LlamaForCausalLM.load_weights`, plus each block's
        ``experts.{gate_up_proj,down_proj}[_bias]`` into :class:`GptOssExperts`."""
        modules = dict(self.named_modules())
        experts_filled: set[str] = set()

        def other_tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                match = _EXPERT_TENSOR.match(name)
                if match is None:
                    yield name, tensor
                    continue
                experts = modules.get(f"{match['block']}.experts")
                if not isinstance(experts, GptOssExperts):
                    raise ValueError(
                        f"checkpoint tensor {name!r} has no counterpart in "
                        f"{type(self).__name__}; is the checkpoint's architecture right?"
                    )
                param = experts.load(match["tensor"], tensor)
                experts_filled.add(f"{match['block']}.experts.{param}")

        return super().load_weights(other_tensors()) | experts_filled
