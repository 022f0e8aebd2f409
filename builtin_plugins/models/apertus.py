"""Apertus (swiss-ai Apertus-8B/70B): the Llama decoder with a non-gated xIELU MLP,
per-head q/k RMSNorms and its own norm names.

As HF transformers' ``Apertus`` code defines it, what differs from Llama:

- the MLP is not gated: ``down_proj(xielu(up_proj(x)))``, no ``gate_proj`` and no biases
  (``hidden_act`` is ``xielu``). xIELU (:class:`XIELU`) has two learned scalars per layer,
  ``act_fn.alpha_p`` and ``act_fn.alpha_n`` (shape ``[1]``, stored before their softplus),
  and two constant ones, ``act_fn.beta`` (0.5) and ``act_fn.eps`` (-1e-6), which HF keeps as
  buffers that the checkpoints carry too::

      a_p = softplus(alpha_p);  a_n = beta + softplus(alpha_n)
      xielu(x) = a_p * x * x + beta * x                          where x > 0
               = (expm1(min(x, eps)) - x) * a_n + beta * x       elsewhere

- ``q_norm``/``k_norm``: an RMSNorm over each head of q and k (weights of ``head_dim``) after
  the projections and before RoPE, as Qwen3's;
- the layer's norms are named ``attention_layernorm`` and ``feedforward_layernorm`` (Llama's
  ``input_layernorm`` and ``post_attention_layernorm``, in the same places);
- ``attention_bias`` puts a bias on q, k, v and o; the MLP never has one;
- RoPE defaults to ``llama3`` scaling (in the config's defaults); no sliding window.

The MLP's projections load as :class:`~chassis.builtin_plugins.models.arcee.ArceeForCausalLM`
loads its non-gated one (``up_proj`` under its own name, only q/k/v merged). Tensor
parallelism is Llama's: each rank holds its heads, its rows of ``up_proj`` and its columns of
``down_proj``; xIELU acts element by element, so its four scalars, like the norms, are whole
on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.arcee import ArceeForCausalLM
from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaAttention
from chassis.core import parallel_state
from chassis.core.attention import ForwardContext
from chassis.core.layers.norm import RMSNorm
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.model_interface import ModelBuildContext

#: the only ``hidden_act`` implemented
ACTIVATION = "xielu"
#: HF's ``XIELUActivation`` defaults (what a checkpoint without the buffers gets)
ALPHA_P_INIT = 0.8
ALPHA_N_INIT = 0.8
BETA = 0.5
EPS = -1e-6
#: xIELU's buffers: checkpoint tensors that are not parameters
_XIELU_BUFFERS = ("beta", "eps")


class XIELU(nn.Module):
    """HF's ``XIELUActivation`` (its Python form): learned ``alpha_p``, ``alpha_n``
    (``[1]``, before softplus; initialized as HF initializes them) and the buffers ``beta``
    and ``eps`` (0-d). Computed in the input dtype with HF's order of operations (the
    scalars cast to it, as HF's model holds them in its dtype)."""

    def __init__(self) -> None:
        super().__init__()
        # softplus^-1 of the initial values, as HF stores them
        alpha_p = torch.log(torch.expm1(torch.tensor(ALPHA_P_INIT)))
        alpha_n = torch.log(torch.expm1(torch.tensor(ALPHA_N_INIT - BETA)))
        self.alpha_p = nn.Parameter(alpha_p.unsqueeze(0), requires_grad=False)
        self.alpha_n = nn.Parameter(alpha_n.unsqueeze(0), requires_grad=False)
        self.register_buffer("beta", torch.tensor(BETA))
        self.register_buffer("eps", torch.tensor(EPS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        beta = self.beta.to(x.dtype)
        alpha_p = nn.functional.softplus(self.alpha_p.to(x.dtype))
        alpha_n = beta + nn.functional.softplus(self.alpha_n.to(x.dtype))
        return torch.where(
            x > 0,
            alpha_p * x * x + beta * x,
            (torch.expm1(torch.minimum(x, self.eps.to(x.dtype))) - x) * alpha_n + beta * x,
        )


class XIELUMLP(nn.Module):
    """``down_proj(act_fn(up_proj(x)))`` without biases; ``spec.intermediate_size`` is this
    rank's share of the columns, and the output is summed over the tensor-parallel group."""

    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)
        self.act_fn = XIELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act_fn(self.up_proj(x)))
        # Each rank holds some columns of the MLP: down_proj's partial sums add up.
        return parallel_state.all_reduce(out)


class ApertusDecoderLayer(nn.Module):
    """Llama's pre-norm layer (called as
    :class:`~chassis.builtin_plugins.models.llama.LlamaDecoderLayer` is, the residual adds
    fused into the norms) with Apertus's norm names."""

    def __init__(
        self,
        spec: DecoderSpec,
        rotary_emb: RotaryEmbedding,
        layer_idx: int,
        build_ctx: ModelBuildContext,
        mlp: nn.Module,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(spec, rotary_emb, layer_idx, build_ctx)
        self.mlp = mlp
        self.attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(mlp output, residual stream)``; their sum is the layer's output."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.attention_layernorm(hidden_states)
        else:
            hidden_states, residual = self.attention_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, ctx)
        hidden_states, residual = self.feedforward_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class ApertusForCausalLM(ArceeForCausalLM):
    """``ApertusForCausalLM`` checkpoints (swiss-ai Apertus-8B/70B, base and instruct).

    Refused at build, with a ``ValueError`` naming the field: a ``hidden_act`` other than
    ``xielu`` and a ``rope_type`` the rotary tables do not implement. A ``sliding_window`` or
    ``mlp_bias`` in the config is ignored, as HF's Apertus ignores them.
    """

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderSpec.from_config(
            hf_config,
            activation=ACTIVATION,
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=False,
            qk_norm=True,
            sliding_window=None,
        )

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> ApertusDecoderLayer:
        return ApertusDecoderLayer(
            self.spec, rotary_emb, layer_idx, build_ctx, self.make_mlp(layer_idx)
        )

    def make_mlp(self, layer_idx: int) -> nn.Module:
        return XIELUMLP(self.spec)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As :meth:`ArceeForCausalLM.load_weights`, with xIELU's ``act_fn.beta`` and
        ``act_fn.eps`` copied into their buffers (whole on every rank; a checkpoint without
        them keeps HF's defaults)."""
        buffers = dict(self.named_buffers())

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                parts = name.split(".")
                if len(parts) < 2 or parts[-2] != "act_fn" or parts[-1] not in _XIELU_BUFFERS:
                    yield name, tensor
                    continue
                buffer = buffers.get(name)
                if buffer is None:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has no counterpart in "
                        f"{type(self).__name__}; is the checkpoint's architecture right?"
                    )
                if tensor.numel() != 1:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                        "expected one value (does config.json match the weights?)"
                    )
                buffer.copy_(tensor.reshape(buffer.shape))

        return super().load_weights(others())
