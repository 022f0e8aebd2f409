"""The causal LM shape of HF's ``backbone`` stacks (Mamba, Mamba2, Nemotron-H): one mixer per
block, each block ``x + mixer(norm(x))``.

``backbone.embeddings``; blocks ``backbone.layers.<i>`` (``norm``, ``mixer``), each called
``(positions, hidden, ctx)`` and returning its mixer's output, which the stack adds to the
residual stream (kept in float32 with ``residual_in_fp32``); ``backbone.norm_f``;
``lm_head``, tied to the embeddings with ``tie_word_embeddings``. The model files say what
differs: the mixers, the block kinds, config defaults and checkpoint names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.llama import filled_parameters
from chassis.core.attention import ForwardContext
from chassis.core.layers.mamba2_mixer import mamba2_checkpoint_part, mamba2_mixers
from chassis.core.layers.norm import RMSNorm
from chassis.core.model_interface import CausalLM, ModelBuildContext
from chassis.core.request_state_cache import RequestStateSpec


class NormMixerBlock(nn.Module):
    """``norm`` then a state ``mixer`` (called ``(x, ctx)``); :meth:`forward` returns the
    mixer output (the caller adds the residual)."""

    def __init__(self, norm: nn.Module, mixer: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.mixer = mixer

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        return self.mixer(self.norm(hidden_states), ctx)


class Backbone(nn.Module):
    """HF's ``backbone``: ``embeddings``, the blocks ``layers``, the final norm ``norm_f``."""

    def __init__(
        self, vocab_size: int, hidden_size: int, layers: Iterable[nn.Module], norm_f: nn.Module
    ) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm_f = norm_f


def rms_norm_backbone(
    hf_config: Any, hidden_size: int, mixer: Callable[[int], nn.Module]
) -> Backbone:
    """The backbone of Mamba-style configs: ``num_hidden_layers`` blocks of an RMSNorm
    (``layer_norm_epsilon``) and ``mixer(i)`` for block ``i``, an RMSNorm ``norm_f``."""
    eps = float(hf_config.layer_norm_epsilon)
    blocks = (
        NormMixerBlock(RMSNorm(hidden_size, eps), mixer(i))
        for i in range(int(hf_config.num_hidden_layers))
    )
    return Backbone(int(hf_config.vocab_size), hidden_size, blocks, RMSNorm(hidden_size, eps))


class BackboneLM(CausalLM):
    """A :class:`Backbone`-shaped model (the module docstring) with its LM head. A block's
    mixer with a ``state_specs`` method carries request state; a mixer with a
    ``checkpoint_part`` method cuts its own tensors under tensor parallelism.

    Subclasses build the backbone and may override :meth:`checkpoint_name` (renames) and
    :meth:`copy_tensor` (tensors that do not load by name)."""

    has_recurrent_state = True

    def __init__(
        self,
        hf_config: Any,
        build_ctx: ModelBuildContext,
        backbone: nn.Module,
        *,
        residual_in_fp32: bool,
        tie_word_embeddings: bool,
    ) -> None:
        """``backbone``: an ``embeddings`` table, ``layers`` of blocks (each with a ``mixer``,
        called ``(positions, hidden, ctx)``) and ``norm_f``, as :class:`Backbone`.
        ``residual_in_fp32``/``tie_word_embeddings``: the defaults for configs that do not
        say."""
        super().__init__(hf_config, build_ctx)
        self.dtype = build_ctx.dtype
        self.residual_in_fp32 = bool(getattr(hf_config, "residual_in_fp32", residual_in_fp32))
        self.backbone = backbone
        self.tie_word_embeddings = bool(
            getattr(hf_config, "tie_word_embeddings", tie_word_embeddings)
        )
        embeddings: nn.Embedding = backbone.embeddings
        head_device = "meta" if self.tie_word_embeddings else None
        self.lm_head = nn.Linear(
            embeddings.embedding_dim, int(hf_config.vocab_size), bias=False, device=head_device
        )
        if self.tie_word_embeddings:
            self.lm_head.weight = embeddings.weight

    def request_state_specs(self) -> list[RequestStateSpec]:
        specs: list[RequestStateSpec] = []
        for i, block in enumerate(self.backbone.layers):
            if callable(getattr(block.mixer, "state_specs", None)):
                specs.extend(block.mixer.state_specs(f"layers.{i}.mixer", self.dtype))
        return specs

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.backbone.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        for block in self.backbone.layers:
            residual = hidden.float() if self.residual_in_fp32 else hidden
            hidden = residual + block(positions, hidden.to(self.dtype), ctx)
        return self.backbone.norm_f(hidden.to(self.dtype))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()

    def checkpoint_name(self, name: str) -> str:
        """The parameter name of checkpoint tensor ``name`` (here: ``name``)."""
        return name

    def copy_tensor(
        self,
        params: dict[str, nn.Parameter],
        name: str,
        tensor: torch.Tensor,
        shards_loaded: dict[str, set[str]],
    ) -> None:
        """Copy ``tensor`` (this rank's part) into parameter ``name`` and note it in
        ``shards_loaded`` (for :func:`~chassis.builtin_plugins.models.llama.
        filled_parameters`); ``ValueError`` for an unknown name or a shape that does not
        match."""
        param = params.get(name)
        if param is None:
            raise ValueError(self.unknown_tensor(name))
        if param.shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                f"{tuple(param.shape)} (does config.json match the weights?)"
            )
        param.data.copy_(tensor)
        shards_loaded.setdefault(name, set()).add("")

    def unknown_tensor(self, name: str) -> str:
        """The error for checkpoint tensor ``name`` that no parameter takes."""
        return (
            f"checkpoint tensor {name!r} has no counterpart in {type(self).__name__}; "
            "is the checkpoint's architecture right?"
        )

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors in (:meth:`checkpoint_name`, then :meth:`copy_tensor`), the
        mixers' tensors cut to this rank's part; ``lm_head.weight`` is skipped when tied.
        Returns the parameters filled; unknown names and shapes that do not match raise
        ``ValueError``."""
        params = dict(self.named_parameters())
        mixers = mamba2_mixers(self)
        shards_loaded: dict[str, set[str]] = {}
        for name, tensor in weights:
            name = self.checkpoint_name(name)
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            tensor = mamba2_checkpoint_part(mixers, name, tensor)  # this rank's part
            self.copy_tensor(params, name, tensor, shards_loaded)
        return filled_parameters(shards_loaded)
