"""The multi-token-prediction (MTP) module of DeepSeek-V3 and GLM-4.5 checkpoints, run as a
speculative-decoding draft head (``--speculative-config`` method ``mtp``; the proposer is
:mod:`chassis.core.mtp`). It is never a model of its own.

DeepSeek-V3/R1 and GLM-4.5/4.6 checkpoints carry ``num_nextn_predict_layers`` MTP modules
after the decoder, at ``model.layers.{num_hidden_layers + i}``. Module ``i = 0`` at position
``p`` reads the token at ``p + 1`` and the target's final hidden state at ``p`` (after the
target's final norm, the state its LM head reads):

    e = enorm(embed(token[p + 1]))       # 0 at position 0 (as vLLM and SGLang do)
    h = hnorm(hidden[p])
    x = eh_proj(cat(e, h))               # Linear(2 * hidden -> hidden), no bias
    x = decoder layer(x)                 # the target's layer kind, its own KV cache
    out = x + residual stream            # the next "hidden" for a following draft
    logits = shared_head.head(shared_head.norm(out))

The decoder layer is the target's: DeepSeek's multi-head latent attention (or GLM-4.5's
grouped-query attention) and the MLP a layer of that index has there (a mixture of experts
past ``first_k_dense_replace``). Checkpoint tensors, under the layer's prefix:
``enorm.weight``, ``hnorm.weight``, ``eh_proj.weight``, ``shared_head.norm.weight``,
``shared_head.head.weight`` (optional: else the target's LM head), ``embed_tokens.weight``
(not read: the published ones equal the target's, which the head shares, as vLLM does) and
the decoder layer's tensors with the target's names. Only the first MTP module is built; with
more drafts per step than modules it runs again on its own output (as vLLM does).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.deepseek_v2 import (
    DeepseekMoeForCausalLM,
    DeepseekV2ForCausalLM,
    MultiHeadLatentAttention,
)
from chassis.builtin_plugins.models.llama import LlamaDecoderLayer
from chassis.core import parallel_state
from chassis.core.attention import ForwardContext
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.layers.vocab_parallel import gather_logits, vocab_shard
from chassis.core.model_interface import CausalLM, ModelBuildContext

#: the MTP module's own tensors (beside its decoder layer's), by their name under the prefix
OWN_TENSORS = (
    "enorm.weight",
    "hnorm.weight",
    "eh_proj.weight",
    "shared_head.norm.weight",
    "shared_head.head.weight",
)


def mtp_layer_prefix(hf_config: Any) -> str:
    """``model.layers.{num_hidden_layers}.``: where the first MTP module's tensors are."""
    return f"model.layers.{int(hf_config.num_hidden_layers)}."


class _SharedHead(nn.Module):
    """``shared_head.norm`` and (when the checkpoint ships one) ``shared_head.head``."""

    def __init__(self, norm: nn.Module, head: nn.Linear | None) -> None:
        super().__init__()
        self.norm = norm
        self.head = head


class MtpHead(CausalLM):
    """The first MTP module of ``target`` (a :class:`DeepseekMoeForCausalLM`: DeepSeek-V2/V3
    or GLM-4.5), built on the current default device and dtype; see the module docstring.

    ``target`` is referenced, not registered as a submodule. ``own_lm_head``: the
    checkpoint ships ``shared_head.head.weight`` (else the target's LM head is used). The
    head's ``hf_config`` is the target's (its KV cache view for MLA) with one layer: the
    draft proposer sizes the head's cache by it.
    """

    merged_projections = None

    def __init__(
        self, target: CausalLM, build_ctx: ModelBuildContext, *, own_lm_head: bool = True
    ) -> None:
        if not isinstance(target, DeepseekMoeForCausalLM):
            raise ValueError(
                f"--speculative-config method 'mtp' runs the MTP layers of DeepSeek-V3 and "
                f"GLM-4.5 checkpoints; the target {type(target).__name__} has none"
            )
        hf_config = copy.copy(target.hf_config)
        #: the decoder layer the module's MLP is built as (its index in the checkpoint)
        self.layer_number = int(hf_config.num_hidden_layers)
        hf_config.num_hidden_layers = 1  # the head's KV caches: one attention layer
        super().__init__(hf_config, build_ctx)
        self._target = (target,)  # a tuple: not a submodule
        spec = target.spec
        hidden, eps = spec.hidden_size, spec.rms_norm_eps
        norm_class = target.norm_class
        self.vocab_size = int(hf_config.vocab_size)
        self.enorm = norm_class(hidden, eps)
        self.hnorm = norm_class(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        rotary = RotaryEmbedding(
            spec.head_dim, spec.max_position, spec.rope, context_len=build_ctx.max_model_len
        )
        # KV cache index 0 (the head's own cache list); the MLP of the checkpoint's layer
        attention = None
        if isinstance(target, DeepseekV2ForCausalLM):
            attention = MultiHeadLatentAttention(target.mla, rotary, 0, build_ctx)
        self.layer = LlamaDecoderLayer(
            spec,
            rotary,
            0,
            build_ctx,
            target.make_mlp(self.layer_number),
            norm_class=norm_class,
            self_attn=attention,
        )
        head = None
        if own_lm_head:
            _, vocab_rows = vocab_shard(self.vocab_size)  # this rank's vocabulary rows
            head = nn.Linear(hidden, vocab_rows, bias=False)
        self.shared_head = _SharedHead(norm_class(hidden, eps), head)

    @property
    def target(self) -> CausalLM:
        """The model the head drafts for."""
        return self._target[0]

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        """``[T, hidden]``: the module's output (before ``shared_head.norm``) from
        ``input_ids`` (``[T]``, the token after each position), ``positions`` (``[T]``) and
        ``hidden_states`` (``[T, hidden]``: the target's final ones at each position, or the
        head's own output for a later draft). Writes the head's K/V at ``ctx``'s slots."""
        embeds = self.target.model.embed(input_ids).to(hidden_states.dtype)
        # The module never reads a token at position 0 (none precedes it in training).
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden_states)), dim=-1))
        x, residual = self.layer(positions, x, None, ctx)
        return x + residual

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 ``[n, vocab]``: ``shared_head.head(shared_head.norm(out))`` (the target's
        LM head when the checkpoint ships none)."""
        normed = self.shared_head.norm(hidden_states)
        head = self.shared_head.head
        if head is None:
            return self.target.compute_logits(normed)
        logits = head(normed)
        if parallel_state.tp_size() > 1:
            logits = gather_logits(logits, self.vocab_size)
        return logits.float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Fill the head from the target checkpoint's tensors of the first MTP module
        (names with :func:`mtp_layer_prefix`; others are an error). The decoder layer's
        tensors load as the target loads its own layers (its loader over this layer, with
        its tensor-parallel shares and expert stacking). Returns the parameters filled."""
        target = self.target
        prefix = mtp_layer_prefix(target.hf_config)
        params = dict(self.named_parameters())
        filled: set[str] = set()

        def layer_tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if not name.startswith(prefix):
                    raise ValueError(f"checkpoint tensor {name!r} is not the MTP layer's")
                rest = name.removeprefix(prefix)
                if rest.startswith("embed_tokens."):
                    continue  # the target's embedding is read instead
                if rest in OWN_TENSORS:
                    if rest == "shared_head.head.weight":
                        # as the target cuts its LM head's rows under tensor parallelism
                        tensor = target._tensor_parallel_slice("lm_head.weight", tensor)
                    param = params.get(rest)
                    if param is None:
                        continue  # shared_head.head without own_lm_head: the target's
                    if param.shape != tensor.shape:
                        raise ValueError(
                            f"MTP tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                            f"{tuple(param.shape)} (does config.json match the weights?)"
                        )
                    param.copy_(tensor)
                    filled.add(rest)
                    continue
                yield "model.layers.0." + rest, tensor

        # The target's loader, run over a view of it holding this one layer: it knows the
        # layer's tensors (MLA's per-head loading, merged projections, experts, rank shares).
        loaded = _layer_loader(target, self.layer).load_weights(layer_tensors())
        filled |= {
            "layer." + n.removeprefix("model.layers.0.")
            for n in loaded
            if n.startswith("model.layers.0.")
        }
        return filled


def _layer_loader(target: CausalLM, layer: nn.Module) -> Any:
    """A shallow copy of ``target`` whose only submodule is a decoder ``model`` holding
    ``layer`` as ``model.layers.0``: its ``load_weights`` (the target's class's) fills
    ``layer`` from tensors named as the target's layer 0. The copy shares the target's plain
    attributes (specs, flags) and none of its modules or parameters; the target is left as
    it was. (A loader that kept a module map of its own from construction would still reach
    the target's modules through the shared attributes: the targets' loaders build theirs
    from ``named_modules``/``named_parameters`` per call.)"""
    decoder = nn.Module()
    decoder.layers = nn.ModuleList([layer])
    view = copy.copy(target)
    # copy.copy shares these dicts with the target: give the view its own
    view.__dict__.update(_parameters={}, _buffers={}, _modules={"model": decoder})
    return view
