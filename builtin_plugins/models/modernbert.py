"""ModernBERT encoders on pooling engines: ``ModernBertModel`` (embedding models:
gte-modernbert-base, modernbert-embed-base) and ``ModernBertForSequenceClassification``
(gte-reranker-modernbert-base and other cross-encoders).

An encoder as :mod:`~chassis.builtin_plugins.models.bert` (``is_encoder_only``, no KV cache,
whole prompts in one step: :mod:`chassis.core.encoder_only`), with HF transformers'
ModernBERT layers instead of BERT's:

- token embeddings only (no position or token-type tables), then a LayerNorm;
- pre-norm residual blocks: ``x + attn(attn_norm(x))`` (layer 0 has no ``attn_norm``: the
  embeddings' norm precedes it), ``x + mlp(mlp_norm(x))``, and a ``final_norm``; every
  LayerNorm without a bias unless ``norm_bias``;
- attention with a fused ``Wqkv`` projection and RoPE (``rotate_half`` layout) whose base
  depends on the layer: ``rope_parameters["full_attention"]`` (``global_rope_theta``) on
  global layers, ``["sliding_attention"]`` (``local_rope_theta``) on local ones;
- global layers attend to the whole prompt, local ones (``config.layer_types``: every layer
  but each ``global_attn_every_n_layers``-th) to a symmetric window of
  ``local_attention // 2`` tokens each side (HF's ``|q - k| <= sliding_window``);
- a GeGLU-style MLP: ``Wo(act(input) * gate)`` with ``input, gate = Wi(x).chunk(2)``.

Module names are the checkpoint's; the ``model.`` prefix ``ModernBertFor*`` checkpoints put
before the encoder is dropped (so a ``ModernBertForMaskedLM`` checkpoint such as
ModernBERT-base loads as ``ModernBertModel`` with ``--hf-overrides '{"architectures":
["ModernBertModel"]}'``, its masked-LM head unused). HF's unpadded (FlashAttention) and
padded (SDPA) paths compute the same; chassis computes each request unpadded within its
boundaries, which is the same again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.bert import _ACTIVATIONS
from chassis.core.attention import ForwardContext
from chassis.core.encoder_only import bidirectional_attention, whole_prompt_lengths
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.model_interface import CausalLM, LoRASlice, ModelBuildContext

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
#: checkpoint tensors the encoder does not use: a masked-LM checkpoint's prediction head and
#: decoder (``head.*`` is the classifier's own head in ``ModernBertForSequenceClassification``)
_UNUSED_PREFIXES = ("head.", "decoder.")
_UNUSED_SUFFIXES = ("inv_freq",)
#: ModernBertConfig's RoPE bases when its rope_parameters name none
_DEFAULT_THETA = {FULL_ATTENTION: 160_000.0, SLIDING_ATTENTION: 10_000.0}


def _activation(hf_config: Any, key: str) -> Any:
    name = getattr(hf_config, key, "gelu")
    if name not in _ACTIVATIONS:
        raise ValueError(f"{key} {name!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _layer_types(hf_config: Any) -> tuple[str, ...]:
    num_layers = int(hf_config.num_hidden_layers)
    every = int(getattr(hf_config, "global_attn_every_n_layers", 3) or 3)
    default = [SLIDING_ATTENTION if i % every else FULL_ATTENTION for i in range(num_layers)]
    layer_types = tuple(getattr(hf_config, "layer_types", None) or default)
    if len(layer_types) != num_layers:
        raise ValueError(f"config.layer_types has {len(layer_types)} entries for {num_layers}")
    unknown = sorted(set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown:
        raise ValueError(
            f"config.layer_types has {unknown}; ModernBERT's layers are {FULL_ATTENTION} "
            f"and {SLIDING_ATTENTION}"
        )
    return layer_types


def _rope_by_layer_type(hf_config: Any) -> dict[str, dict[str, Any]]:
    """Each layer type's RoPE parameters: transformers 5's nested ``rope_parameters``, or
    4.x's ``global_rope_theta`` / ``local_rope_theta``. Only plain RoPE (``default``)."""
    nested = getattr(hf_config, "rope_parameters", None)
    result = {}
    for layer_type, old_key in (
        (FULL_ATTENTION, "global_rope_theta"),
        (SLIDING_ATTENTION, "local_rope_theta"),
    ):
        params = dict((nested or {}).get(layer_type) or {}) if isinstance(nested, dict) else {}
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type != "default":
            raise ValueError(
                f"ModernBERT RoPE type {rope_type!r} ({layer_type} layers) is not supported "
                "(plain RoPE only)"
            )
        theta = params.get("rope_theta") or getattr(hf_config, old_key, None)
        result[layer_type] = {
            "rope_type": "default",
            "rope_theta": float(theta or _DEFAULT_THETA[layer_type]),
        }
    return result


def _layer_norm(hf_config: Any) -> nn.LayerNorm:
    return nn.LayerNorm(
        int(hf_config.hidden_size),
        eps=float(getattr(hf_config, "norm_eps", 1e-5)),
        bias=bool(getattr(hf_config, "norm_bias", False)),
    )


class ModernBertEmbeddings(nn.Module):
    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(int(hf_config.vocab_size), int(hf_config.hidden_size))
        self.norm = _layer_norm(hf_config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertAttention(nn.Module):
    def __init__(
        self, hf_config: Any, rotary_emb: RotaryEmbedding, max_distance: int | None
    ) -> None:
        super().__init__()
        hidden = int(hf_config.hidden_size)
        self.num_heads = int(hf_config.num_attention_heads)
        if hidden % self.num_heads:
            raise ValueError(f"hidden_size {hidden} is not a multiple of {self.num_heads} heads")
        self.head_dim = hidden // self.num_heads
        bias = bool(getattr(hf_config, "attention_bias", False))
        self.Wqkv = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.Wo = nn.Linear(hidden, hidden, bias=bias)
        self.rotary_emb = rotary_emb  # shared by the layers of one type
        self.max_distance = max_distance

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        shape = (x.shape[0], self.num_heads, self.head_dim)
        q, k, v = (t.reshape(shape) for t in self.Wqkv(x).chunk(3, dim=-1))
        q, k = self.rotary_emb(positions, q, k)
        out = bidirectional_attention(
            q,
            k,
            v,
            ctx.attn_metadata,
            1.0 / math.sqrt(self.head_dim),
            max_distance=self.max_distance,
        )
        return self.Wo(out.reshape(x.shape))


class ModernBertMLP(nn.Module):
    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        hidden, inter = int(hf_config.hidden_size), int(hf_config.intermediate_size)
        bias = bool(getattr(hf_config, "mlp_bias", False))
        self.Wi = nn.Linear(hidden, 2 * inter, bias=bias)
        self.Wo = nn.Linear(inter, hidden, bias=bias)
        self.act = _activation(hf_config, "hidden_activation")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(value) * gate)


class ModernBertEncoderLayer(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        max_distance: int | None,
    ) -> None:
        super().__init__()
        # layer 0 reads the embeddings' norm: HF's attn_norm there is the identity
        self.attn_norm = nn.Identity() if layer_idx == 0 else _layer_norm(hf_config)
        self.attn = ModernBertAttention(hf_config, rotary_emb, max_distance)
        self.mlp_norm = _layer_norm(hf_config)
        self.mlp = ModernBertMLP(hf_config)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions, ctx)
        return x + self.mlp(self.mlp_norm(x))


class ModernBertModel(CausalLM):
    """HF ``ModernBertModel`` checkpoints as embedding models: :meth:`forward` returns every
    token's last hidden state (after ``final_norm``, HF's ``last_hidden_state``), which the
    pooling engine pools (``CLS`` by default, as BERT; a sentence-transformers ``1_Pooling``
    config names its own: CLS for gte-modernbert-base, mean for modernbert-embed-base)."""

    is_encoder_only = True
    default_pooling_type = "CLS"
    merged_projections: dict[str, str] = {}

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        super().__init__(hf_config, build_ctx)
        hidden, heads = int(hf_config.hidden_size), int(hf_config.num_attention_heads)
        if hidden % heads:
            raise ValueError(f"hidden_size {hidden} is not a multiple of {heads} heads")
        head_dim = hidden // heads
        layer_types = _layer_types(hf_config)
        rope = _rope_by_layer_type(hf_config)
        max_position = int(hf_config.max_position_embeddings)
        window = int(getattr(hf_config, "local_attention", 128)) // 2
        rotaries = {
            kind: RotaryEmbedding(
                head_dim, max_position, rope[kind], context_len=build_ctx.max_model_len
            )
            for kind in sorted(set(layer_types))
        }
        self.embeddings = ModernBertEmbeddings(hf_config)
        self.layers = nn.ModuleList(
            ModernBertEncoderLayer(
                hf_config, i, rotaries[kind], window if kind == SLIDING_ATTENTION else None
            )
            for i, kind in enumerate(layer_types)
        )
        self.final_norm = _layer_norm(hf_config)

    @property
    def num_attention_layers(self) -> int:
        return 0  # no KV cache: each prompt is computed whole, in one step

    # -- forward ------------------------------------------------------------------------

    def encode(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """The last hidden states ``[num_tokens, hidden_size]`` of the step's prompts (each
        whole: the runner's ``positions`` are each token's place in its prompt)."""
        whole_prompt_lengths(ctx.attn_metadata)
        x = self.embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, positions, ctx)
        return self.final_norm(x)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        return self.encode(input_ids, positions, ctx)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The rows as float32: an encoder has no LM head (a pooling engine never samples;
        this serves its memory profile)."""
        return hidden_states.float()

    # -- weights ------------------------------------------------------------------------

    #: tensors of the checkpoint this class skips (see :data:`_UNUSED_PREFIXES`)
    unused_prefixes: tuple[str, ...] = _UNUSED_PREFIXES

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            param = params.get(name)
            if param is None:
                if name.startswith(self.unused_prefixes) or name.endswith(_UNUSED_SUFFIXES):
                    continue
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has no place in {type(self).__name__}"
                )
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(param.shape)} (does config.json match the weights?)"
                )
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        return loaded


class _PredictionHead(nn.Module):
    """HF's ``ModernBertPredictionHead``: ``norm(act(dense(x)))``."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        hidden = int(hf_config.hidden_size)
        self.dense = nn.Linear(
            hidden, hidden, bias=bool(getattr(hf_config, "classifier_bias", False))
        )
        self.act = _activation(hf_config, "classifier_activation")
        self.norm = _layer_norm(hf_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class ModernBertForSequenceClassification(ModernBertModel):
    """HF ``ModernBertForSequenceClassification`` checkpoints (gte-reranker-modernbert-base,
    ...): ``classifier(head(pooled))`` where ``pooled`` is the first token's last hidden
    state (``classifier_pooling: "cls"``) or the mean of the prompt's (``"mean"``).

    :meth:`forward` returns every token's class logits for ``"cls"`` (the engine pools the
    first token's, ``CLS`` by default: HF's); for ``"mean"`` the model averages each
    prompt's hidden states itself (the head is not linear, so the engine cannot average the
    logits) and gives every token of the prompt the logits of that mean, which any pooling
    type then returns."""

    is_sequence_classifier = True
    unused_prefixes = ("decoder.",)

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        super().__init__(hf_config, build_ctx)
        self.classifier_pooling = str(getattr(hf_config, "classifier_pooling", "cls"))
        if self.classifier_pooling not in ("cls", "mean"):
            raise ValueError(
                f"classifier_pooling {self.classifier_pooling!r} is not supported "
                "(ModernBERT's are 'cls' and 'mean')"
            )
        self.head = _PredictionHead(hf_config)
        self.classifier = nn.Linear(int(hf_config.hidden_size), int(hf_config.num_labels))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        hidden = self.encode(input_ids, positions, ctx)
        if self.classifier_pooling == "mean":
            lengths = whole_prompt_lengths(ctx.attn_metadata).to(hidden.device)
            request = torch.repeat_interleave(
                torch.arange(len(lengths), device=hidden.device), lengths
            )
            sums = hidden.new_zeros(len(lengths), hidden.shape[-1]).index_add_(0, request, hidden)
            means = sums / lengths[:, None].to(hidden.dtype)
            return self.classifier(self.head(means))[request]
        return self.classifier(self.head(hidden))

    def lora_slices(self, module_name: str, module: nn.Module) -> list[LoRASlice]:
        if module_name.startswith(("head.", "classifier")):
            return []  # the head: PEFT trains it whole (modules_to_save), refused
        return super().lora_slices(module_name, module)
