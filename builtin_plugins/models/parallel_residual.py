"""Shared pieces of the GPT-NeoX-style decoders (GPT-NeoX/Pythia, Phi-1/1.5/2, StableLM,
GPT-J): a decoder layer with an optional parallel residual, checkpoint names other than
Llama's, and an LM head with a bias.

A layer of these architectures is one of::

    parallel:   h = h + attn(ln_a(h)) + mlp(ln_m(h))
    sequential: h = h + attn(ln_a(h));  h = h + mlp(ln_m(h))

where ``ln_m`` is ``ln_a`` itself in the one-norm layouts (Phi, GPT-J, StableLM's parallel
layers) and a second norm otherwise (GPT-NeoX). :class:`ParallelResidualLayer` computes both,
called as :class:`~chassis.builtin_plugins.models.llama.LlamaDecoderLayer` is so that
:class:`~chassis.builtin_plugins.models.llama.LlamaModel` runs it.

Their checkpoints name the modules differently (``gpt_neox.layers.N.attention.dense``,
``transformer.h.N.attn.out_proj``, ``mlp.fc1``). :class:`CheckpointRenames` renames each
checkpoint tensor to the Llama layout the model is built in (and back, for the module names
LoRA adapters use), so that loading, tensor-parallel cuts and LoRA slices stay Llama's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaAttention
from chassis.core import parallel_state
from chassis.core.attention import ForwardContext
from chassis.core.layers.activation import GELU_APPROXIMATIONS
from chassis.core.layers.norm import RMSNorm
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.layers.vocab_parallel import vocab_shard
from chassis.core.model_interface import LoRASlice, ModelBuildContext

#: HF ``hidden_act`` / ``activation_function`` -> ``F.gelu``'s ``approximate``: the core
#: table and ``gelu_new`` (Phi, GPT-J, GPT-2), the tanh formula written out, which equals
#: torch's tanh GELU to float rounding.
GELU_ACTIVATIONS = {**GELU_APPROXIMATIONS, "gelu_new": "tanh"}


def gelu_approximate(activation: str, architecture: str, field: str = "hidden_act") -> str:
    """``F.gelu``'s ``approximate`` for the config's activation; a ``ValueError`` naming it,
    ``architecture`` and the config ``field`` it was read from (the one to change) when it
    is not a GELU this module knows."""
    if activation not in GELU_ACTIVATIONS:
        raise ValueError(
            f"{architecture} {field} {activation!r} is not supported; supported: "
            f"{', '.join(GELU_ACTIVATIONS)}"
        )
    return GELU_ACTIVATIONS[activation]


class ParallelResidualLayer(nn.Module):
    """One decoder layer: ``input_layernorm``, ``self_attn``, ``mlp`` and, unless the MLP
    reads the input norm's output (``shared_norm`` with ``parallel``), a
    ``post_attention_layernorm``.

    ``parallel``: attention and MLP both read the layer's input (the sum of the two is
    added to it); otherwise the MLP reads the stream after the attention's add. The
    residual adds are not fused into the norms (the MLP of a parallel layer needs the
    un-normalized input too): ``forward`` returns ``(block output, stream)`` whose sum is
    the layer's output, as :class:`~chassis.builtin_plugins.models.llama.LlamaModel`
    expects.
    """

    def __init__(
        self,
        spec: DecoderSpec,
        self_attn: nn.Module,
        mlp: nn.Module,
        norm_class: type[RMSNorm],
        *,
        parallel: bool,
        shared_norm: bool,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.shared_norm = shared_norm and parallel
        #: ``(positions, [T, hidden], ctx) -> [T, hidden]``, summed over a tensor-parallel group
        self.self_attn = self_attn
        #: ``[T, hidden] -> [T, hidden]``, summed over a tensor-parallel group
        self.mlp = mlp
        self.input_layernorm = norm_class(spec.hidden_size, spec.rms_norm_eps)
        if not self.shared_norm:
            self.post_attention_layernorm = norm_class(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(attention + MLP output, layer input)`` when parallel, else ``(MLP
        output, layer input + attention output)``."""
        stream = hidden_states if residual is None else hidden_states + residual
        normed = self.input_layernorm(stream)
        attn_out = self.self_attn(positions, normed, ctx)
        if self.parallel:
            mlp_in = normed if self.shared_norm else self.post_attention_layernorm(stream)
            return attn_out + self.mlp(mlp_in), stream
        stream = stream + attn_out
        return self.mlp(self.post_attention_layernorm(stream)), stream

    def extra_repr(self) -> str:
        return f"parallel={self.parallel}, shared_norm={self.shared_norm}"


def make_attention(
    spec: DecoderSpec, rotary_emb: RotaryEmbedding, layer_idx: int, build_ctx: ModelBuildContext
) -> LlamaAttention:
    """Llama's attention for layer ``layer_idx`` (merged ``qkv_proj``, ``o_proj``), with the
    spec's window; the caller may replace its q/k norms."""
    return LlamaAttention(
        spec,
        rotary_emb,
        layer_idx,
        build_ctx,
        sliding_window=spec.attention_window(layer_idx, build_ctx.max_model_len),
    )


def _replace_all(name: str, renames: Iterable[tuple[str, str]]) -> str:
    # on "." + name + "." so that a pattern anchored by dots matches at either end too
    dotted = f".{name}."
    for old, new in renames:
        dotted = dotted.replace(old, new)
    return dotted[1:-1]


class CheckpointRenames:
    """Mixin for a :class:`~chassis.builtin_plugins.models.llama.LlamaForCausalLM` subclass
    (listed before it) whose checkpoint names differ from the Llama layout it is built in.

    :attr:`checkpoint_renames` are ``(checkpoint, ours)`` substring pairs, dot-delimited
    (``".attention.dense."``), applied in order to ``"." + name + "."``; the reverse pairs,
    in reverse order, give a module's checkpoint name back (LoRA adapters name those).
    Tensors ending in :attr:`ignored_checkpoint_suffixes` (attention-mask buffers of old
    checkpoints) are skipped. :meth:`checkpoint_tensors` may cut one renamed tensor into
    several (GPT-NeoX's fused Q/K/V).

    With :attr:`lm_head_bias` the LM head has a bias, cut by vocabulary rows under tensor
    parallelism as its weight is.
    """

    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    ignored_checkpoint_suffixes: tuple[str, ...] = ()
    lm_head_bias: bool = False

    # the attributes and methods of LlamaForCausalLM this mixin uses
    lm_head: nn.Linear
    vocab_size: int

    def ours(self, checkpoint_name: str) -> str:
        """The Llama-layout name of a checkpoint tensor or module."""
        return _replace_all(checkpoint_name, self.checkpoint_renames)

    def checkpoint_name(self, our_name: str) -> str:
        """The checkpoint's name of one of our tensors or modules (:meth:`ours` undone)."""
        return _replace_all(
            our_name, ((new, old) for old, new in reversed(self.checkpoint_renames))
        )

    def checkpoint_tensors(
        self, name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors (our names) one renamed checkpoint tensor loads as: itself by
        default."""
        yield name, tensor

    def build_head(self, hf_config: Any) -> None:
        super().build_head(hf_config)  # type: ignore[misc]
        if self.lm_head_bias:
            _, vocab_rows = vocab_shard(self.vocab_size)
            self.lm_head.bias = nn.Parameter(torch.zeros(vocab_rows))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As the Llama loader, after each checkpoint tensor is renamed (and cut) to ours. A
        ``ValueError`` about a tensor (its name ours) also names it as the checkpoint does."""
        current = [""]

        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.endswith(self.ignored_checkpoint_suffixes):
                    continue
                current[0] = name
                yield from self.checkpoint_tensors(self.ours(name), tensor)

        try:
            return super().load_weights(renamed())  # type: ignore[misc]
        except ValueError as error:
            if not current[0] or current[0] in str(error):
                raise
            raise ValueError(f"{error} (checkpoint name {current[0]!r})") from error

    def _tensor_parallel_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The base class's cut, and the LM head's bias by vocabulary rows (zeros past the
        vocabulary, as the weight's rows are padded)."""
        if name == "lm_head.bias" and parallel_state.tp_size() > 1:
            start, rows = vocab_shard(self.vocab_size)
            part = tensor[start : start + rows]
            if part.shape[0] < rows:
                part = torch.cat([part, part.new_zeros(rows - part.shape[0])])
            return part
        return super()._tensor_parallel_slice(name, tensor)  # type: ignore[misc]

    def lora_slices(self, module_name: str, module: nn.Module) -> list[LoRASlice]:
        """The base class's slices, named as the checkpoint names the projections."""
        slices = super().lora_slices(module_name, module)  # type: ignore[misc]
        return [s._replace(hf_module=self.checkpoint_name(s.hf_module)) for s in slices]

    def lora_shard(
        self, hf_module: str, lora_a: torch.Tensor, lora_b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As the base class cuts the projection :meth:`ours` names."""
        return super().lora_shard(self.ours(hf_module), lora_a, lora_b)  # type: ignore[misc]
