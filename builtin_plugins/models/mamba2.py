"""Mamba2 (``Mamba2ForCausalLM``: state-spaces/mamba2-*, mistralai/Mamba-Codestral-7B): a
stack of Mamba2 mixers, no attention.

As HF transformers' ``Mamba2`` code defines it: ``backbone.embeddings``; each block
``backbone.layers.<i>`` is ``x + mixer(norm(x))`` (an RMSNorm, then a
:class:`~chassis.core.layers.mamba2_mixer.Mamba2Mixer`), the residual stream kept in float32
with ``residual_in_fp32``; ``backbone.norm_f``; ``lm_head`` (tied to the embeddings with
``tie_word_embeddings``). No KV cache: every layer carries a state per request.

Tensor parallel: each rank keeps its share of every mixer's heads and groups
(:mod:`chassis.core.layers.mamba2_shard`; ``num_heads`` must divide by the ranks, and
``n_groups`` divide them or by them), and the mixers' outputs are summed over the group; the
embeddings, norms and LM head are whole on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from chassis.core.attention import ForwardContext
from chassis.core.layers.mamba2_mixer import (
    Mamba2Mixer,
    Mamba2Spec,
    check_silu,
    mamba2_checkpoint_part,
    mamba2_mixers,
)
from chassis.core.layers.mamba2_shard import mamba2_shard
from chassis.core.layers.norm import RMSNorm
from chassis.core.model_interface import CausalLM, ModelBuildContext
from chassis.core.request_state_cache import RequestStateSpec


def mamba2_spec(hf_config: Any) -> Mamba2Spec:
    """The mixer of a ``Mamba2Config``."""
    check_silu(hf_config)
    hidden = int(hf_config.hidden_size)
    limit = getattr(hf_config, "time_step_limit", None) or (0.0, float("inf"))
    return Mamba2Spec(
        hidden_size=hidden,
        num_heads=int(hf_config.num_heads),
        head_dim=int(hf_config.head_dim),
        d_state=int(hf_config.state_size),
        n_groups=int(hf_config.n_groups),
        d_conv=int(hf_config.conv_kernel),
        intermediate_size=int(hf_config.expand * hidden),
        chunk_size=int(getattr(hf_config, "chunk_size", 256) or 256),
        conv_bias=bool(hf_config.use_conv_bias),
        proj_bias=bool(hf_config.use_bias),
        norm_eps=float(hf_config.layer_norm_epsilon),
        time_step_limit=(float(limit[0]), float(limit[1])),
    )


class Mamba2Block(nn.Module):
    """``norm`` then ``mixer``; :meth:`forward` returns the mixer output (the caller adds
    the residual)."""

    def __init__(self, spec: Mamba2Spec, eps: float, state_index: int) -> None:
        super().__init__()
        self.norm = RMSNorm(spec.hidden_size, eps)
        self.mixer = Mamba2Mixer(spec, state_index)

    def forward(self, hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.mixer(self.norm(hidden_states), ctx)


class Mamba2Backbone(nn.Module):
    """HF's ``backbone``: embeddings, blocks, final norm."""

    def __init__(self, hf_config: Any, spec: Mamba2Spec) -> None:
        super().__init__()
        eps = float(hf_config.layer_norm_epsilon)
        self.embeddings = nn.Embedding(int(hf_config.vocab_size), spec.hidden_size)
        self.layers = nn.ModuleList(
            Mamba2Block(spec, eps, 2 * i) for i in range(int(hf_config.num_hidden_layers))
        )
        self.norm_f = RMSNorm(spec.hidden_size, eps)


class Mamba2ForCausalLM(CausalLM):
    """``Mamba2ForCausalLM`` checkpoints. Layer ``i`` holds request-state tensors ``2i``
    (conv) and ``2i + 1`` (SSM). Refused when built: a ``hidden_act`` other than ``silu``,
    mixer shapes that do not fit, or that do not split over ``--tensor-parallel-size``."""

    supports_tensor_parallel = True
    has_recurrent_state = True

    @classmethod
    def check_tensor_parallel(cls, hf_config: Any, size: int) -> None:
        mamba2_shard(mamba2_spec(hf_config), size, 0)

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        super().__init__(hf_config, build_ctx)
        self.spec = mamba2_spec(hf_config)
        self.dtype = build_ctx.dtype
        self.residual_in_fp32 = bool(getattr(hf_config, "residual_in_fp32", True))
        self.backbone = Mamba2Backbone(hf_config, self.spec)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        head_device = "meta" if self.tie_word_embeddings else None
        self.lm_head = nn.Linear(
            self.spec.hidden_size, int(hf_config.vocab_size), bias=False, device=head_device
        )
        if self.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    @property
    def num_attention_layers(self) -> int:
        return 0

    def request_state_specs(self) -> list[RequestStateSpec]:
        specs: list[RequestStateSpec] = []
        for i, layer in enumerate(self.backbone.layers):
            specs.extend(layer.mixer.state_specs(f"layers.{i}.mixer", self.dtype))
        return specs

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.backbone.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.backbone.layers:
            residual = hidden.float() if self.residual_in_fp32 else hidden
            hidden = residual + layer(hidden.to(self.dtype), ctx)
        return self.backbone.norm_f(hidden.to(self.dtype))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors by name (older checkpoints' ``backbone.embedding`` is
        ``backbone.embeddings``); ``lm_head.weight`` is skipped when tied. Unknown names and
        shapes that do not match raise ``ValueError``."""
        params = dict(self.named_parameters())
        mixers = mamba2_mixers(self)
        filled: set[str] = set()
        for name, tensor in weights:
            name = name.replace("backbone.embedding.", "backbone.embeddings.")
            tensor = mamba2_checkpoint_part(mixers, name, tensor)  # this rank's part
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no counterpart in {type(self).__name__}; "
                    "is the checkpoint's architecture right?"
                )
            if param.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(param.shape)} (does config.json match the weights?)"
                )
            param.data.copy_(tensor)
            filled.add(name)
        return filled
