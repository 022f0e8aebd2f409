"""The EAGLE-1 draft head (``--speculative-config`` method ``eagle``): its layers and weights.

Registered as architecture ``EagleLlamaForCausalLM`` (vLLM's name); the proposer
(:mod:`chassis.core.eagle`) builds it over the target. It is never a model of its own.

An EAGLE-1 head predicts the target's next hidden state from the target's current one. At
position ``p`` it reads the token at ``p + 1`` and the target's last hidden state at ``p``
(after the target's final norm, the state its LM head reads):

    x = fc(cat(embed(token[p + 1]), hidden[p]))          # Linear(2 * hidden -> hidden)
    x = decoder layers(x)                                 # Llama layers, own KV cache
    next hidden = x (+ the residual stream), no final norm

and the target's LM head turns it into the logits of the token at ``p + 2``. For the next
draft the head feeds its own output as ``hidden``. The first decoder layer has no input norm
(the reference implementation drops it: ``fc``'s output goes straight into attention).

Checkpoints (the yuhuili ``EAGLE-*`` heads and those converted for vLLM) hold a Llama
``config.json`` (``num_hidden_layers`` is the head's, usually 1; ``hidden_size`` the
target's) and tensors named ``fc.weight`` (``fc.bias`` optional), ``layers.{i}.*`` as in a
Llama decoder layer (``layers.0.input_layernorm.weight`` absent), optionally
``embed_tokens.weight`` and ``lm_head.weight``; a ``model.`` prefix is accepted. Without its
own ``embed_tokens`` / ``lm_head`` the head uses the target's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.eagle_head_base import EagleHeadBase
from chassis.builtin_plugins.models.llama import (  # the head's layers are Llama's
    LlamaDecoderLayer,
    LlamaMLP,
    copy_checkpoint_tensor,
    filled_parameters,
)
from chassis.core.attention import ForwardContext
from chassis.core.model_interface import CausalLM, ModelBuildContext


def head_tensor_name(name: str) -> str:
    """A head checkpoint's tensor name without the ``model.`` prefix some conversions add."""
    return name.removeprefix("model.")


class EagleLlamaHead(EagleHeadBase):
    """An EAGLE-1 head of Llama decoder layers over the target ``target``.

    ``own_embedding`` / ``own_lm_head``: the checkpoint ships ``embed_tokens.weight`` /
    ``lm_head.weight`` (else the target's embedding and :meth:`CausalLM.compute_logits` are
    used; see :class:`EagleHeadBase`).
    """

    method = "eagle"
    label = "EAGLE"
    architecture = "EagleLlamaForCausalLM"

    def __init__(
        self,
        hf_config: Any,
        build_ctx: ModelBuildContext,
        target: CausalLM | None = None,
        *,
        own_embedding: bool = False,
        own_lm_head: bool = False,
    ) -> None:
        super().__init__(hf_config, build_ctx, target, own_embedding=own_embedding)
        spec = self.spec
        hidden = spec.hidden_size
        self.lm_head = nn.Linear(hidden, self.vocab_size, bias=False) if own_lm_head else None
        # EAGLE-1's fc has a bias in the reference training code, none in some conversions:
        # a missing fc.bias loads as zeros (the same function).
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        rotary = self.head_rotary(build_ctx)
        layers = []
        for i in range(int(hf_config.num_hidden_layers)):
            layer = LlamaDecoderLayer(spec, rotary, i, build_ctx, LlamaMLP(spec))
            if i == 0:
                layer.input_layernorm = nn.Identity()  # fc's output goes straight in
            layers.append(layer)
        self.layers = nn.ModuleList(layers)

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        """``[T, hidden]``: the head's prediction of the target's next hidden state, from
        ``input_ids`` (``[T]``, the token after each position), ``positions`` (``[T]``) and
        ``hidden_states`` (``[T, hidden]``: the target's at each position, or the head's own
        output for a draft step). Writes the head's K/V at ``ctx``'s slots."""
        embeds = self.embed(input_ids).to(hidden_states.dtype)
        x = self.fc(torch.cat((embeds, hidden_states), dim=-1))
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx)
        return x if residual is None else x + residual

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 ``[n, vocab]`` from the head's output: its own LM head, or the target's."""
        if self.lm_head is not None:
            return self.lm_head(hidden_states).float()
        return self.target.compute_logits(hidden_states)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy head checkpoint tensors in (names as in the module docstring); returns the
        parameters now filled. ``fc.bias`` missing counts as zeros; the first layer's
        ``input_layernorm.weight``, if a checkpoint has one, is not used (the reference
        does not apply it). Unknown names or wrong shapes raise ``ValueError``."""
        params = dict(self.named_parameters())
        shards_loaded: dict[str, set[str]] = {}
        for raw_name, tensor in weights:
            name = head_tensor_name(raw_name)
            if name.endswith("rotary_emb.inv_freq") or name == "layers.0.input_layernorm.weight":
                continue
            copy_checkpoint_tensor(
                params,
                self.spec,
                name,
                tensor,
                shards_loaded,
                unknown=f"EAGLE head tensor {raw_name!r} has no counterpart in an EAGLE-1 "
                "Llama head (fc, layers.N.*, embed_tokens, lm_head); is it an EAGLE-1 head?",
                label=f"EAGLE head tensor {raw_name!r}",
                hint="does its config.json match its weights?",
            )
        if "fc.bias" not in shards_loaded:
            self.fc.bias.zero_()
            shards_loaded["fc.bias"] = {""}
        return filled_parameters(shards_loaded)
