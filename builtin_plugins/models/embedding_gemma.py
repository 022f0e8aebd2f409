"""EmbeddingGemma (google/embeddinggemma-300m): Gemma 3's text layers as an encoder.

Its ``config.json`` declares ``Gemma3TextModel`` with ``use_bidirectional_attention: true``,
which HF transformers runs as Gemma 3 with the causal mask replaced:

- the full-attention layers attend to every token of the prompt;
- the sliding layers attend in a symmetric window: keys fewer than ``sliding_window``
  places away on either side. ``Gemma3TextConfig`` halves the window of a bidirectional
  config when it reads it (``sliding_window // 2 + 1``: the checkpoint's 512 becomes 257,
  256 places each side), so the config chassis reads already holds that value.

Everything else is :class:`~chassis.builtin_plugins.models.gemma3.Gemma3ForCausalLM`'s: the
embeddings scaled by ``sqrt(hidden_size)``, sandwich norms, per-head q/k norms, RoPE bases
per layer type, GeGLU. The model is an encoder on a pooling engine
(:mod:`chassis.core.encoder_only`): whole prompts in one step, no KV cache, each layer's
paged attention replaced by :func:`~chassis.core.encoder_only.bidirectional_attention`
within each request (and the window on the sliding layers). It has no LM head; the
checkpoint's sentence-transformers folder (mean pooling, two ``Dense`` projections,
``Normalize``) is read as for any embedding model (:mod:`chassis.core.pooling_dense`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.gemma import (
    SLIDING_ATTENTION,
    GemmaDecoderLayer,
)
from chassis.builtin_plugins.models.gemma3 import Gemma3ForCausalLM
from chassis.builtin_plugins.models.llama import LlamaModel
from chassis.core.attention import ForwardContext
from chassis.core.encoder_only import bidirectional_attention
from chassis.core.layers.norm import GemmaRMSNorm
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.model_interface import ModelBuildContext


class EncoderSelfAttention(nn.Module):
    """What a decoder layer's paged ``Attention`` is replaced with in an encoder: the same
    call (``q [T, H, D]`` or ``[T, H*D]``, ``k``/``v [T, KV*D]`` -> ``[T, H*D]``), computed
    by :func:`bidirectional_attention` over each request's tokens, grouped KV heads repeated
    for their query heads; ``max_distance`` is a symmetric window (``None``: none)."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        max_distance: int | None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"{num_heads} attention heads do not group evenly over {num_kv_heads} KV heads"
            )
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.max_distance = max_distance

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        out = bidirectional_attention(
            q, k, v, ctx.attn_metadata, self.scale, max_distance=self.max_distance
        )
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"max_distance={self.max_distance}"
        )


class EmbeddingGemmaModel(Gemma3ForCausalLM):
    """HF ``Gemma3TextModel`` checkpoints with ``use_bidirectional_attention`` (EmbeddingGemma)
    as embedding models: :meth:`forward` returns every token's last hidden state (after the
    final norm, HF's ``last_hidden_state``), which the pooling engine pools (``MEAN`` by
    default, what EmbeddingGemma's sentence-transformers folder says; the folder's own
    ``1_Pooling`` wins when present).

    Weights load as Gemma 3's; a base-model checkpoint names its tensors without the
    ``model.`` prefix (``layers.0.self_attn.q_proj.weight``), which is added. Tensor
    parallelism is not supported (refused at start)."""

    is_encoder_only = True
    default_pooling_type = "MEAN"
    supports_tensor_parallel = False

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        if not getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError(
                "Gemma3TextModel without use_bidirectional_attention (the hidden states of a "
                "causal Gemma 3 decoder) is not supported as an embedding model; chassis runs "
                "Gemma3TextModel checkpoints that set it (EmbeddingGemma). Serve a causal "
                "Gemma 3 as Gemma3ForCausalLM"
            )
        super().__init__(hf_config, build_ctx)

    @property
    def num_attention_layers(self) -> int:
        return 0  # no KV cache: each prompt is computed whole, in one step

    def build_head(self, hf_config: Any) -> None:
        self.tie_word_embeddings = False  # no LM head: an lm_head.weight tensor is skipped

    def build_decoder(self, hf_config: Any, build_ctx: ModelBuildContext) -> LlamaModel:
        """Gemma 3's decoder (:meth:`GemmaForCausalLM.build_decoder`, without its refusal of
        bidirectional configs), whose layers :meth:`make_layer` builds."""
        self.options = self.gemma_options(hf_config)
        embed_scale = float(
            torch.tensor(self.spec.hidden_size**0.5, dtype=build_ctx.dtype, device="cpu")
        )
        rope = self.options.rope_by_layer_type
        return LlamaModel(
            hf_config,
            self.spec,
            build_ctx,
            self.make_layer,
            norm_class=GemmaRMSNorm,
            embedding_multiplier=embed_scale,
            rope_per_layer=[rope[kind] for kind in self.options.layer_types],
        )

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> GemmaDecoderLayer:
        """A Gemma 3 layer whose attention is :class:`EncoderSelfAttention`: the whole prompt
        on full layers, a symmetric window of ``sliding_window - 1`` places each side
        (HF's ``|q - k| < sliding_window``) on sliding ones."""
        # built without a window: the paged layer it replaces never runs
        spec = dataclasses.replace(self.spec, sliding_window=None)
        layer = GemmaDecoderLayer(spec, self.options, rotary_emb, layer_idx, build_ctx)
        max_distance = None
        if self.options.layer_types[layer_idx] == SLIDING_ATTENTION:
            max_distance = int(self.hf_config.sliding_window) - 1
        layer.self_attn.attn = EncoderSelfAttention(
            spec.num_heads, spec.head_dim, spec.num_kv_heads, self.options.attn_scale, max_distance
        )
        return layer

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The rows as float32: an encoder has no LM head (a pooling engine never samples;
        this serves its memory profile)."""
        return hidden_states.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name == "lm_head.weight":
                    continue  # a causal checkpoint's head: embeddings do not use it
                yield (name if name.startswith("model.") else f"model.{name}"), tensor

        return super().load_weights(renamed())
