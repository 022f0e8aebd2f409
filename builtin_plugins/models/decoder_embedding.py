"""Decoder embedding checkpoints that declare the bare decoder (HF's ``*Model`` class).

Many embedding models built on a decoder LM save it without its LM head, as HF's base
class: ``config.json`` names ``MistralModel`` (intfloat/e5-mistral-7b-instruct,
Salesforce/SFR-Embedding-Mistral), ``Gemma2Model`` (BAAI/bge-multilingual-gemma2),
``LlamaModel``, ``Qwen2Model`` or ``Qwen3Model``, and the tensors are named without the
``model.`` prefix (``layers.0.self_attn.q_proj.weight``, ``embed_tokens.weight``,
``norm.weight``). The classes here are those decoders (Llama, Qwen2, Qwen3, Gemma 2's) with
no head: :meth:`forward` returns every token's final hidden state (after the last norm,
HF's ``last_hidden_state``), which a pooling engine pools, by default the last token,
normalized (vLLM's default for these architectures; a checkpoint's sentence-transformers
``1_Pooling`` wins). They declare ``is_pooling_only``: ``--runner auto`` picks
``"pooling"`` and ``"generate"`` is refused (:func:`~chassis.core.pooling_classify.resolve_runner`).

Weights load with or without the ``model.`` prefix (a ``*ForCausalLM`` checkpoint renamed
to the bare class loads too); an ``lm_head.weight`` is skipped.

``is_causal: false`` in the config (``config.json`` or ``--hf-overrides '{"is_causal":
false}'``, as vLLM reads it for Llama, Qwen2 and Qwen3 decoders, e.g. for
Alibaba-NLP/gte-Qwen2-7B-instruct) builds the bidirectional variant
(:meth:`BareDecoderEmbedding.class_for_config`): every token attends to the whole prompt,
computed as the encoders are (:mod:`chassis.core.encoder_only`: whole prompts in one step,
no KV cache, no chunked prefill or prefix caching).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from chassis.builtin_plugins.models.embedding_gemma import EncoderSelfAttention
from chassis.builtin_plugins.models.gemma2 import Gemma2ForCausalLM
from chassis.builtin_plugins.models.llama import LlamaForCausalLM
from chassis.builtin_plugins.models.qwen2 import Qwen2ForCausalLM
from chassis.builtin_plugins.models.qwen3 import Qwen3ForCausalLM
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.model_interface import CausalLM, ModelBuildContext


def is_bidirectional(hf_config: Any) -> bool:
    """Whether the config asks for bidirectional attention (``is_causal`` set false)."""
    return getattr(hf_config, "is_causal", True) is False


class BareDecoderEmbedding:
    """The head-less decoder of a bare ``*Model`` checkpoint (listed first among the bases
    of a decoder class): no LM head, hidden states out, pooling engines only."""

    is_pooling_only = True
    default_pooling_type = "LAST"
    #: the variant built for ``is_causal: false`` configs; ``None``: refused
    bidirectional_class: ClassVar[type[CausalLM] | None] = None

    hf_config: Any
    tie_word_embeddings: bool

    @classmethod
    def class_for_config(cls, hf_config: Any) -> type[CausalLM]:
        if not is_bidirectional(hf_config) or getattr(cls, "is_encoder_only", False):
            return cls  # type: ignore[return-value]
        if cls.bidirectional_class is None:
            raise ValueError(
                f"is_causal: false (bidirectional attention) is not supported for "
                f"{cls.__name__}; chassis runs it for LlamaModel, MistralModel, Qwen2Model "
                "and Qwen3Model checkpoints"
            )
        return cls.bidirectional_class

    def build_head(self, hf_config: Any) -> None:
        self.tie_word_embeddings = False  # no LM head: a checkpoint's lm_head.weight is skipped

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The rows as float32: the model has no LM head (a pooling engine never samples;
        this serves its memory profile)."""
        return hidden_states.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name == "lm_head.weight":
                    continue  # a causal LM's head: embeddings do not use it
                yield (name if name.startswith("model.") else f"model.{name}"), tensor

        return super().load_weights(renamed())  # type: ignore[misc]


class BidirectionalDecoder:
    """A bare decoder whose ``is_causal`` is false: each layer's paged attention replaced
    by :class:`~chassis.builtin_plugins.models.embedding_gemma.EncoderSelfAttention` over
    the whole prompt, as an encoder (:mod:`chassis.core.encoder_only`). Not sharded over a
    tensor-parallel group (refused at start)."""

    is_encoder_only = True
    supports_tensor_parallel = False

    spec: Any

    @property
    def num_attention_layers(self) -> int:
        return 0  # no KV cache: each prompt is computed whole, in one step

    def make_layer(
        self, layer_idx: int, rotary_emb: RotaryEmbedding, build_ctx: ModelBuildContext
    ) -> nn.Module:
        window = self.spec.attention_window(layer_idx, build_ctx.max_model_len)
        if window is not None:
            raise ValueError(
                f"is_causal: false with a sliding window ({window}, layer {layer_idx}) is not "
                "supported: bidirectional attention here covers the whole prompt"
            )
        layer = super().make_layer(layer_idx, rotary_emb, build_ctx)  # type: ignore[misc]
        spec = self.spec
        layer.self_attn.attn = EncoderSelfAttention(
            spec.num_heads, spec.head_dim, spec.num_kv_heads, spec.head_dim**-0.5, None
        )
        return layer


class LlamaEmbeddingModel(BareDecoderEmbedding, LlamaForCausalLM):
    """``LlamaModel`` / ``MistralModel`` checkpoints (e5-mistral-7b-instruct,
    SFR-Embedding-Mistral): the Llama decoder without its LM head."""


class Qwen2EmbeddingModel(BareDecoderEmbedding, Qwen2ForCausalLM):
    """``Qwen2Model`` checkpoints: the Qwen2 decoder without its LM head."""


class Qwen3EmbeddingModel(BareDecoderEmbedding, Qwen3ForCausalLM):
    """``Qwen3Model`` checkpoints: the Qwen3 decoder without its LM head."""


class Gemma2EmbeddingModel(BareDecoderEmbedding, Gemma2ForCausalLM):
    """``Gemma2Model`` checkpoints (bge-multilingual-gemma2): the Gemma 2 decoder (scaled
    embeddings, sandwich norms, sliding layers, attention soft cap) without its LM head (nor
    the final logit soft cap, which only applies to logits)."""


class BidirectionalLlamaEmbeddingModel(BidirectionalDecoder, LlamaEmbeddingModel):
    """``LlamaModel`` / ``MistralModel`` with ``is_causal: false``."""


class BidirectionalQwen2EmbeddingModel(BidirectionalDecoder, Qwen2EmbeddingModel):
    """``Qwen2Model`` with ``is_causal: false`` (gte-Qwen2's bidirectional attention)."""


class BidirectionalQwen3EmbeddingModel(BidirectionalDecoder, Qwen3EmbeddingModel):
    """``Qwen3Model`` with ``is_causal: false``."""


LlamaEmbeddingModel.bidirectional_class = BidirectionalLlamaEmbeddingModel
Qwen2EmbeddingModel.bidirectional_class = BidirectionalQwen2EmbeddingModel
Qwen3EmbeddingModel.bidirectional_class = BidirectionalQwen3EmbeddingModel
