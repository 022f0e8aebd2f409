"""BERT-family encoders on pooling engines: ``BertModel``, ``RobertaModel``,
``XLMRobertaModel`` (embedding models: all-MiniLM, bge, e5, gte, bge-m3, multilingual-e5)
and their ``*ForSequenceClassification`` cross-encoders (ms-marco-MiniLM, bge-reranker).

An encoder attends in both directions within each prompt and caches nothing: the model
declares ``is_encoder_only`` and 0 attention layers, the engine computes every prompt
whole in one step (:mod:`chassis.core.encoder_only`), and each layer runs SDPA within the
requests' boundaries (``ctx.attn_metadata.query_start_loc_cpu``). Layers as HF's: absolute
position embeddings, token-type embeddings, post-LayerNorm residual blocks, a GELU MLP.
Module names are the checkpoint's, so weights load by name (a ``bert.`` / ``roberta.``
prefix, as ``Bert*For*`` checkpoints save the encoder, is dropped).

Token types: 0 everywhere, as HF's default, except for a BERT classifier whose config has
two types (``type_vocab_size``: cross-encoders trained on sentence pairs): there the tokens
after a prompt's first ``[SEP]`` are type 1, what BERT tokenizers write for a pair
(``[CLS] query [SEP] document [SEP]``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chassis.core.attention import ForwardContext
from chassis.core.encoder_only import bidirectional_attention, whole_prompt_lengths
from chassis.core.model_interface import CausalLM, LoRASlice, ModelBuildContext

#: HF ``hidden_act`` names -> the activation
_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}
#: checkpoint tensors an encoder does not use: a base model's pooler (embedding models pool
#: the last hidden states), pre-training and masked-LM heads, saved position-id buffers
_UNUSED_PREFIXES = ("pooler.", "cls.", "lm_head.")
_UNUSED_SUFFIXES = ("position_ids", "token_type_ids")


def _check_config(hf_config: Any) -> None:
    kind = getattr(hf_config, "position_embedding_type", "absolute")
    if kind not in (None, "absolute"):
        raise ValueError(
            f"position_embedding_type {kind!r} is not supported (absolute position embeddings only)"
        )
    if getattr(hf_config, "is_decoder", False) or getattr(hf_config, "add_cross_attention", False):
        raise ValueError("BERT as a decoder (is_decoder, cross-attention) is not supported")
    act = getattr(hf_config, "hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(
            f"hidden_act {act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}"
        )


class BertEmbeddings(nn.Module):
    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        hidden = int(hf_config.hidden_size)
        self.word_embeddings = nn.Embedding(int(hf_config.vocab_size), hidden)
        self.position_embeddings = nn.Embedding(int(hf_config.max_position_embeddings), hidden)
        self.token_type_embeddings = nn.Embedding(int(hf_config.type_vocab_size), hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=float(hf_config.layer_norm_eps))

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x + self.position_embeddings(position_ids))


class BertSelfAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        if hidden % num_heads:
            raise ValueError(f"hidden_size {hidden} is not a multiple of {num_heads} heads")
        self.num_heads = num_heads
        self.head_dim = hidden // num_heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        shape = (x.shape[0], self.num_heads, self.head_dim)  # [T, heads, head_dim]
        out = bidirectional_attention(
            self.query(x).view(shape),
            self.key(x).view(shape),
            self.value(x).view(shape),
            ctx.attn_metadata,
            1.0 / math.sqrt(self.head_dim),
        )
        return out.reshape(x.shape)


class BertDenseNorm(nn.Module):
    """``LayerNorm(dense(x) + residual)``: HF's ``BertSelfOutput`` and ``BertOutput``."""

    def __init__(self, in_features: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        hidden = int(hf_config.hidden_size)
        # ``self``: the checkpoint's name (attention.self.query, ...)
        self.self = BertSelfAttention(hidden, int(hf_config.num_attention_heads))
        self.output = BertDenseNorm(hidden, hidden, float(hf_config.layer_norm_eps))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.output(self.self(x, ctx), x)


class BertIntermediate(nn.Module):
    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.dense = nn.Linear(int(hf_config.hidden_size), int(hf_config.intermediate_size))
        self.act = _ACTIVATIONS[getattr(hf_config, "hidden_act", "gelu")]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.attention = BertAttention(hf_config)
        self.intermediate = BertIntermediate(hf_config)
        self.output = BertDenseNorm(
            int(hf_config.intermediate_size),
            int(hf_config.hidden_size),
            float(hf_config.layer_norm_eps),
        )

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.attention(x, ctx)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(
            BertLayer(hf_config) for _ in range(int(hf_config.num_hidden_layers))
        )

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, ctx)
        return x


class BertModel(CausalLM):
    """HF ``BertModel`` checkpoints as embedding models: :meth:`forward` returns every
    token's last hidden state (HF's ``last_hidden_state``), which the pooling engine pools
    (``CLS`` by default, as vLLM; a sentence-transformers ``1_Pooling`` config names its
    own). The checkpoint's ``pooler`` (BERT's CLS projection) is not used by embeddings."""

    is_encoder_only = True
    default_pooling_type = "CLS"
    merged_projections: dict[str, str] = {}
    #: prefixes ``*For*`` checkpoints put before the encoder's tensors
    checkpoint_prefixes: tuple[str, ...] = ("bert.",)

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        super().__init__(hf_config, build_ctx)
        _check_config(hf_config)
        self.embeddings = BertEmbeddings(hf_config)
        self.encoder = BertEncoder(hf_config)

    @property
    def num_attention_layers(self) -> int:
        return 0  # no KV cache: each prompt is computed whole, in one step

    # -- forward ------------------------------------------------------------------------

    def encode(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """The last hidden states ``[num_tokens, hidden_size]`` of the step's prompts."""
        lengths = whole_prompt_lengths(ctx.attn_metadata)
        request = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        request = request.to(input_ids.device)
        x = self.embeddings(
            input_ids,
            self.position_ids(input_ids, positions, request),
            self.token_type_ids(input_ids, request),
        )
        return self.encoder(x, ctx)

    def position_ids(
        self, input_ids: torch.Tensor, positions: torch.Tensor, request: torch.Tensor
    ) -> torch.Tensor:
        """Each token's row of the position table: its place in its prompt (the whole
        prompt is in the step, so the runner's ``positions``)."""
        return positions

    def token_type_ids(self, input_ids: torch.Tensor, request: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        return self.encode(input_ids, positions, ctx)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The rows as float32: an encoder has no LM head (a pooling engine never samples;
        this serves its memory profile)."""
        return hidden_states.float()

    # -- weights ------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = self._parameter_name(hf_name)
            param = params.get(name)
            if param is None:
                if name.startswith(_UNUSED_PREFIXES) or name.endswith(_UNUSED_SUFFIXES):
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

    def _parameter_name(self, hf_name: str) -> str:
        for prefix in self.checkpoint_prefixes:
            if hf_name.startswith(prefix):
                hf_name = hf_name.removeprefix(prefix)
                break
        # TF-era checkpoints name LayerNorm parameters gamma and beta
        if hf_name.endswith(".gamma"):
            return hf_name.removesuffix(".gamma") + ".weight"
        if hf_name.endswith(".beta"):
            return hf_name.removesuffix(".beta") + ".bias"
        return hf_name


class RobertaModel(BertModel):
    """HF ``RobertaModel`` / ``XLMRobertaModel`` checkpoints: BERT's layers, with position
    ids counted from ``pad_token_id + 1`` (pad tokens keep ``pad_token_id``), as HF computes
    them from the token ids; so the context is ``max_position_embeddings - pad_token_id - 1``
    tokens (512 of 514)."""

    checkpoint_prefixes = ("roberta.",)

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        super().__init__(hf_config, build_ctx)
        self.padding_idx = int(hf_config.pad_token_id)

    @classmethod
    def context_length(cls, hf_config: Any) -> int | None:
        return int(hf_config.max_position_embeddings) - int(hf_config.pad_token_id) - 1

    def position_ids(
        self, input_ids: torch.Tensor, positions: torch.Tensor, request: torch.Tensor
    ) -> torch.Tensor:
        # HF: cumsum(not pad) * not_pad + pad_token_id, within each prompt
        real = (input_ids != self.padding_idx).to(torch.int64)
        counts = torch.cumsum(real, 0)
        before = (counts - real)[_first_token_of_each(request)]  # real tokens before each
        return (counts - before[request]) * real + self.padding_idx


def _first_token_of_each(request: torch.Tensor) -> torch.Tensor:
    """The flat index of each request's first token (``request``: each token's request,
    ascending, every request with a token)."""
    is_first = torch.ones_like(request, dtype=torch.bool)
    is_first[1:] = request[1:] != request[:-1]
    return torch.nonzero(is_first).flatten()


class BertForSequenceClassification(BertModel):
    """HF ``BertForSequenceClassification`` checkpoints (classifiers, cross-encoders such as
    ms-marco-MiniLM): :meth:`forward` returns every token's class logits
    ``classifier(tanh(pooler.dense(h)))``; the engine pools the first token's (``CLS``),
    which is HF's ``BertPooler`` then ``classifier``."""

    is_sequence_classifier = True

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        super().__init__(hf_config, build_ctx)
        hidden = int(hf_config.hidden_size)
        self.pooler = nn.Module()
        self.pooler.dense = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, int(hf_config.num_labels))
        #: the [SEP] token that ends a pair's first text (None: one token type)
        self.sep_token_id = _sep_token_id(hf_config) if hf_config.type_vocab_size > 1 else None

    def token_type_ids(self, input_ids: torch.Tensor, request: torch.Tensor) -> torch.Tensor:
        """Type 1 for the tokens after each prompt's first ``[SEP]``, as a BERT tokenizer
        writes a pair (``[CLS] a [SEP] b [SEP]``); a single text, whose only ``[SEP]`` ends
        it, is all type 0."""
        if self.sep_token_id is None:
            return torch.zeros_like(input_ids)
        sep = (input_ids == self.sep_token_id).to(torch.int64)
        counts = torch.cumsum(sep, 0) - sep  # [SEP]s before each token, from the first prompt
        before = counts - counts[_first_token_of_each(request)][request]
        return (before > 0).to(torch.int64)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        hidden = self.encode(input_ids, positions, ctx)
        return self.classifier(torch.tanh(self.pooler.dense(hidden)))

    def lora_slices(self, module_name: str, module: nn.Module) -> list[LoRASlice]:
        if module_name.startswith(("pooler.", "classifier")):
            return []  # the head: PEFT trains it whole (modules_to_save), refused
        return super().lora_slices(module_name, module)


class RobertaForSequenceClassification(RobertaModel):
    """HF ``RobertaForSequenceClassification`` / ``XLMRobertaForSequenceClassification``
    checkpoints (bge-reranker-base, ...): :meth:`forward` returns every token's
    ``classifier.out_proj(tanh(classifier.dense(h)))``; the engine pools the first token's
    (``<s>``), HF's classification head."""

    is_sequence_classifier = True

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        super().__init__(hf_config, build_ctx)
        hidden = int(hf_config.hidden_size)
        self.classifier = nn.Module()
        self.classifier.dense = nn.Linear(hidden, hidden)
        self.classifier.out_proj = nn.Linear(hidden, int(hf_config.num_labels))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        hidden = self.encode(input_ids, positions, ctx)
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(hidden)))

    def lora_slices(self, module_name: str, module: nn.Module) -> list[LoRASlice]:
        if module_name.startswith("classifier"):
            return []  # the head: PEFT trains it whole (modules_to_save), refused
        return super().lora_slices(module_name, module)


def _sep_token_id(hf_config: Any) -> int:
    """The ``[SEP]`` token id of a BERT pair classifier: ``config.json``'s ``sep_token_id``,
    else the tokenizer's in the checkpoint folder (``tokenizer.json``'s added tokens, or
    ``vocab.txt``), with the separator ``tokenizer_config.json`` or
    ``special_tokens_map.json`` names (``[SEP]`` by default)."""
    stated = getattr(hf_config, "sep_token_id", None)
    if isinstance(stated, int):
        return stated
    directory = Path(str(getattr(hf_config, "_name_or_path", "") or "."))
    token = "[SEP]"
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        data = _read_json(directory / name)
        value = data.get("sep_token") if isinstance(data, dict) else None
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            token = value
            break
    tokenizer = _read_json(directory / "tokenizer.json")
    if isinstance(tokenizer, dict):
        for added in tokenizer.get("added_tokens") or []:
            if isinstance(added, dict) and added.get("content") == token:
                return int(added["id"])
        vocab = (tokenizer.get("model") or {}).get("vocab")
        if isinstance(vocab, dict) and token in vocab:
            return int(vocab[token])
    vocab_file = directory / "vocab.txt"
    if vocab_file.is_file():
        for index, line in enumerate(vocab_file.read_text(encoding="utf-8").splitlines()):
            if line.strip() == token:
                return index
    raise ValueError(
        f"{directory}: a BERT classifier with token types needs its {token} token id to tell "
        "a pair's two texts apart, and the checkpoint's tokenizer files do not give it; set "
        "--hf-overrides '{\"sep_token_id\": N}'"
    )


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
