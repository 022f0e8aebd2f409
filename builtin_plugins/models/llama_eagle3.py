"""The EAGLE-3 draft head (``--speculative-config`` method ``eagle3``): its layer and weights.

Registered as architecture ``LlamaForCausalLMEagle3`` (the published heads' name) and
``Eagle3LlamaForCausalLM`` (vLLM's); the proposer (:mod:`chassis.core.eagle3`) builds it over
the target. It is never a model of its own.

An EAGLE-3 head reads hidden states of several target layers (the residual stream entering
each of ``eagle_aux_hidden_state_layer_ids``, by default ``(2, L // 2, L - 3)``), not only
the last one, and predicts the next token over a vocabulary of its own. At position ``p`` it
reads the token at ``p + 1`` and a hidden state ``h``:

    h = fc(cat(aux_1[p], aux_2[p], aux_3[p]))     # first draft step: Linear(3 * target_hidden
                                                  # -> hidden), no bias
    a = cat(input_layernorm(embed(token[p + 1])), hidden_norm(h))    # 2 * hidden wide
    r = h + o_proj(attention(a))                  # q/k/v read 2 * hidden; own KV cache
    out = r + mlp(post_attention_layernorm(r))    # the head's pre-norm output
    logits = lm_head(norm(out))                   # over the draft vocabulary

and the next draft step reads ``out`` as ``h`` (no ``fc``). Draft id ``d`` is target id
``d + d2t[d]``. (With ``norm_before_residual`` true in the config, as the speculators format
sets it, the residual is ``hidden_norm(h)`` instead of ``h``.)

Checkpoints (yuhuili ``EAGLE3-*``, SpecForge's output) hold a Llama ``config.json`` with
``draft_vocab_size``, optionally ``target_hidden_size`` and
``eagle_aux_hidden_state_layer_ids``, and tensors ``fc.weight``,
``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``,
``norm.weight``, ``lm_head.weight`` (``[draft_vocab, hidden]``), ``d2t`` (int64
``[draft_vocab]``; needed when the draft vocabulary is smaller than the target's), ``t2d``
(not used), optionally ``embed_tokens.weight`` (else the target's embedding is used); a
``model.`` prefix and ``layers.0.`` for ``midlayer.`` are accepted.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.eagle_head_base import EagleHeadBase
from chassis.builtin_plugins.models.llama import (  # the head's parts are Llama's
    DecoderSpec,
    LlamaAttention,
    LlamaMLP,
    copy_checkpoint_tensor,
    filled_parameters,
)
from chassis.core.attention import ForwardContext
from chassis.core.layers.norm import RMSNorm
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.model_interface import CausalLM, ModelBuildContext


def eagle3_tensor_name(name: str) -> str:
    """A head checkpoint's tensor name in this module's terms: no ``model.`` prefix, and the
    decoder layer named ``midlayer.`` whether the checkpoint calls it so or ``layers.0.``."""
    name = name.removeprefix("model.")
    if name.startswith("layers.0."):
        return "midlayer." + name.removeprefix("layers.0.")
    return name


class Eagle3DecoderLayer(nn.Module):
    """The head's one decoder layer: attention over ``cat(normed embeds, normed hidden)``
    (``2 * hidden`` wide), then a Llama MLP."""

    def __init__(
        self,
        spec: DecoderSpec,
        rotary: RotaryEmbedding,
        build_ctx: ModelBuildContext,
        norm_before_residual: bool,
    ) -> None:
        super().__init__()
        hidden = spec.hidden_size
        self.self_attn = LlamaAttention(spec, rotary, 0, build_ctx, input_size=2 * hidden)
        self.mlp = LlamaMLP(spec)
        self.input_layernorm = RMSNorm(hidden, spec.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, spec.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        hidden_states: torch.Tensor,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream)``: their sum is the head's pre-norm output."""
        normed = self.hidden_norm(hidden_states)
        residual = normed if self.norm_before_residual else hidden_states
        attention_in = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        out = self.self_attn(positions, attention_in, ctx)
        out, residual = self.post_attention_layernorm(out, residual)
        return self.mlp(out), residual


class Eagle3LlamaHead(EagleHeadBase):
    """An EAGLE-3 head over the target ``target`` (see the module docstring and
    :class:`EagleHeadBase`).

    ``own_embedding``: the checkpoint ships ``embed_tokens.weight`` (else the target's
    embedding is read). ``hf_config.vocab_size`` is the target's vocabulary,
    ``draft_vocab_size`` the head's (default: the same); :meth:`compute_logits` returns
    logits over the target's ids.
    """

    method = "eagle3"
    label = "EAGLE-3"
    architecture = "LlamaForCausalLMEagle3"

    def __init__(
        self,
        hf_config: Any,
        build_ctx: ModelBuildContext,
        target: CausalLM | None = None,
        *,
        own_embedding: bool = False,
    ) -> None:
        super().__init__(hf_config, build_ctx, target, own_embedding=own_embedding)
        spec = self.spec
        hidden = spec.hidden_size
        self.draft_vocab_size = int(getattr(hf_config, "draft_vocab_size", None) or self.vocab_size)
        self.target_hidden_size = int(getattr(hf_config, "target_hidden_size", None) or hidden)
        #: the target layers whose entering hidden states ``fc`` reads, in its order
        self.aux_layer_ids = tuple(
            int(i) for i in getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None) or ()
        ) or (0, 0, 0)  # not named: three, the target's default ones (set by the loader)
        self.fc = nn.Linear(len(self.aux_layer_ids) * self.target_hidden_size, hidden, bias=False)
        self.midlayer = Eagle3DecoderLayer(
            spec,
            self.head_rotary(build_ctx),
            build_ctx,
            bool(getattr(hf_config, "norm_before_residual", False)),
        )
        self.norm = RMSNorm(hidden, spec.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, self.draft_vocab_size, bias=False)
        #: ``[draft_vocab]`` int64, the target id of each draft id (``d + d2t[d]``), set when
        #: the checkpoint's ``d2t`` is loaded; None: the draft ids are the target's
        self.draft_to_target: torch.Tensor | None = None

    @property
    def num_attention_layers(self) -> int:
        """One: the head's ``midlayer`` (whatever ``num_hidden_layers`` its config says)."""
        return 1

    def combine_hidden_states(self, aux_hidden_states: list[torch.Tensor]) -> torch.Tensor:
        """``[T, hidden]``: ``fc`` over the target's auxiliary hidden states (``[T,
        target_hidden]`` each, in the head's layer order), the first draft step's input."""
        return self.fc(torch.cat(aux_hidden_states, dim=-1))

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        """``[T, hidden]``: the head's pre-norm output from ``input_ids`` (``[T]``, the
        token after each position), ``positions`` and ``hidden_states`` (``[T, hidden]``:
        :meth:`combine_hidden_states` of the target's, or the head's own previous output).
        Writes the head's K/V at ``ctx``'s slots."""
        embeds = self.embed(input_ids).to(hidden_states.dtype)
        out, residual = self.midlayer(positions, embeds, hidden_states, ctx)
        return out + residual

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 ``[n, vocab]`` over the *target's* ids from the head's pre-norm output:
        the draft vocabulary's logits at their target ids (``d + d2t[d]``), ``-inf``
        elsewhere, so that argmax and the sampler's distributions live on the draft
        vocabulary (a token outside it has probability 0)."""
        draft = self.lm_head(self.norm(hidden_states)).float()
        if self.draft_to_target is None:
            return draft  # the target's own ids (the loader checked the sizes agree)
        out = draft.new_full((draft.shape[0], self.vocab_size), float("-inf"))
        return out.index_copy_(1, self.draft_to_target, draft)

    def greedy_draft_ids(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n]`` int64 target ids: the argmax of :meth:`compute_logits` per row, without
        widening to the target's vocabulary. The argmax over the draft vocabulary, mapped
        through ``d2t``: the same token, since every other target id scores ``-inf`` there
        (ties resolve to the lowest draft id, the lowest target id too while ``d2t`` keeps
        draft ids in target order, as published heads do). The logits stay in the model's
        dtype: the cast to float32 is exact, so it cannot change the argmax."""
        draft = self.lm_head(self.norm(hidden_states)).argmax(dim=-1)
        return draft if self.draft_to_target is None else self.draft_to_target[draft]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy head checkpoint tensors in (names as in the module docstring); returns the
        parameters now filled. ``t2d`` is skipped; ``d2t`` sets :attr:`draft_to_target` (it
        is not a parameter: a draft vocabulary of the target's size needs none).
        Unknown names, wrong shapes and a ``d2t`` whose target ids fall outside the
        target's vocabulary or repeat raise ``ValueError``."""
        params = dict(self.named_parameters())
        shards_loaded: dict[str, set[str]] = {}
        for raw_name, tensor in weights:
            name = eagle3_tensor_name(raw_name)
            if name.endswith("rotary_emb.inv_freq") or name == "t2d":
                continue
            if name == "d2t":
                self._load_d2t(tensor)
                continue
            copy_checkpoint_tensor(
                params,
                self.spec,
                name,
                tensor,
                shards_loaded,
                unknown=f"EAGLE-3 head tensor {raw_name!r} has no counterpart in an EAGLE-3 "
                "Llama head (fc, midlayer.*, norm, lm_head, d2t, t2d, embed_tokens); is it "
                "an EAGLE-3 head?",
                label=f"EAGLE-3 head tensor {raw_name!r}",
                hint="does its config.json match its weights?",
            )
        return filled_parameters(shards_loaded)

    def _load_d2t(self, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != (self.draft_vocab_size,):
            raise ValueError(
                f"the EAGLE-3 head's d2t has shape {tuple(tensor.shape)}, expected "
                f"({self.draft_vocab_size},) (draft_vocab_size)"
            )
        target_ids = torch.arange(self.draft_vocab_size) + tensor.to(torch.int64).cpu()
        low, high = int(target_ids.min()), int(target_ids.max())
        if low < 0 or high >= self.vocab_size or target_ids.unique().numel() != len(target_ids):
            raise ValueError(
                "the EAGLE-3 head's d2t maps draft ids to target ids outside 0 .. "
                f"{self.vocab_size - 1} or to one target id twice: is it this target's head?"
            )
        self.draft_to_target = target_ids.to(self.lm_head.weight.device)
