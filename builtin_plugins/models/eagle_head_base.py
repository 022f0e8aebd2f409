"""What the EAGLE-1 and EAGLE-3 draft heads share: the target they are built over, the token
embedding they read (their own or the target's) and a rotary table long enough for the
target's context.

A head is a :class:`~chassis.core.model_interface.CausalLM` only so that the model runner
can build, load and run it like a model; it is never served alone, so building one without
a target is a ``ValueError`` that says how to pass it instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.llama import DecoderSpec
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.model_interface import CausalLM, ModelBuildContext


class EagleHeadBase(CausalLM):
    """A draft head over ``target`` (referenced, not registered as a submodule, so neither
    its weights nor the platform's kernel preparation are duplicated).

    Subclasses set :attr:`method` (the ``--speculative-config`` method), :attr:`label` (how
    messages name the head) and :attr:`architecture` (the registered name messages quote).
    ``own_embedding``: the checkpoint ships ``embed_tokens.weight`` (registered here, first
    of the head's parameters); else the target's ``model.embed_tokens`` is read, and a
    target without one is a ``ValueError``.
    """

    merged_projections = None
    method = ""
    label = ""
    architecture = ""

    def __init__(
        self,
        hf_config: Any,
        build_ctx: ModelBuildContext,
        target: CausalLM | None,
        *,
        own_embedding: bool,
    ) -> None:
        super().__init__(hf_config, build_ctx)
        if target is None:
            raise ValueError(
                f"{self.architecture} is an {self.label} draft head, not a model: pass it as "
                f'--speculative-config \'{{"method": "{self.method}", "model": PATH}}\' '
                "beside its target"
            )
        self.spec = spec = DecoderSpec.from_config(hf_config)
        self.vocab_size = int(hf_config.vocab_size)
        self._target = (target,)  # a tuple: not a submodule
        self.own_embedding = own_embedding
        target_embedding = getattr(getattr(target, "model", None), "embed_tokens", None)
        if own_embedding:
            self.embed_tokens: nn.Module = nn.Embedding(self.vocab_size, spec.hidden_size)
        elif target_embedding is None:
            raise ValueError(
                f"the {self.label} head ships no embed_tokens.weight and the target "
                f"{type(target).__name__} has no model.embed_tokens to share"
            )
        self._target_embedding = (target_embedding,)

    @property
    def target(self) -> CausalLM:
        """The target the head drafts for."""
        return self._target[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings the head reads (its own, or the target's)."""
        if self.own_embedding:
            return self.embed_tokens(input_ids)
        return self._target_embedding[0](input_ids)

    def head_rotary(self, build_ctx: ModelBuildContext) -> RotaryEmbedding:
        """The rotary table of the head's attention. The head runs at every position of the
        target's context, which may outgrow the head's own ``max_position_embeddings``
        (published EAGLE-3 heads say 2048): the table covers both (the frequencies do not
        depend on its length)."""
        spec = self.spec
        positions = max(spec.max_position, build_ctx.max_model_len or 0)
        return RotaryEmbedding(
            spec.head_dim, positions, spec.rope, context_len=build_ctx.max_model_len
        )
