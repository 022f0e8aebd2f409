"""The decoder layer of hybrid models whose layers hold either attention or a state mixer.

Jamba (Mamba-1), LFM2 (short convolutions) and Qwen3-Next (Gated DeltaNet) share one layer
shape: pre-norm, one mixer (attention, called ``(positions, hidden, ctx)``, or a state
mixer, called ``(hidden, ctx)``: it reads and writes its request-state slots), post-norm,
MLP, the residual add fused into the norms. A subclass names its state mixer's attribute
(the checkpoint's name: ``mamba``, ``conv``, ``linear_attn``), the mixer's class and the norm.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from chassis.builtin_plugins.models.llama import DecoderSpec
from chassis.core.attention import ForwardContext
from chassis.core.layers.norm import RMSNorm
from chassis.core.request_state_cache import RequestStateSpec


class HybridDecoderLayer(nn.Module):
    """A pre-norm layer around a state mixer (:attr:`state_mixer_name`) or attention
    (``self_attn``) and ``mlp``; returns ``(mlp output, residual stream)`` as
    :class:`~chassis.builtin_plugins.models.llama.LlamaDecoderLayer`. The attribute the
    layer does not hold is ``None``."""

    #: the state mixer's attribute, as the checkpoint names it
    state_mixer_name: str = "mamba"
    #: the state mixer's class: a ``mixer`` of this class is the state mixer
    state_mixer_cls: type[nn.Module] = nn.Module
    #: the two norms' class (``(hidden_size, eps)``; called ``(x)`` or ``(x, residual)``)
    norm_cls: type[nn.Module] = RMSNorm

    def __init__(self, spec: DecoderSpec, mixer: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        is_state = isinstance(mixer, self.state_mixer_cls)
        setattr(self, self.state_mixer_name, mixer if is_state else None)
        self.self_attn: nn.Module | None = None if is_state else mixer
        self.mlp = mlp
        self.input_layernorm = self.norm_cls(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = self.norm_cls(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if self.self_attn is None:
            hidden_states = getattr(self, self.state_mixer_name)(hidden_states, ctx)
        else:
            hidden_states = self.self_attn(positions, hidden_states, ctx)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


def hybrid_state_specs(layers: Iterable[nn.Module], dtype: torch.dtype) -> list[RequestStateSpec]:
    """The request-state tensors of :class:`HybridDecoderLayer` ``layers``, layer by layer:
    each state mixer's ``state_specs`` named ``layers.{i}.{state_mixer_name}``."""
    specs: list[RequestStateSpec] = []
    for i, layer in enumerate(layers):
        mixer = getattr(layer, layer.state_mixer_name)
        if mixer is not None:
            specs.extend(mixer.state_specs(f"layers.{i}.{layer.state_mixer_name}", dtype))
    return specs
