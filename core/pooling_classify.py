"""Sequence-classification models on a pooling engine: vLLM's ``classify`` task and
cross-encoder scoring.

A sequence classifier (a registered model class with ``is_sequence_classifier``, such as the
``*ForSequenceClassification`` ones: its head is ``score``, a bias-free linear layer from the
hidden size to ``num_labels``) runs under ``runner="pooling"``: the model projects
every token's final hidden state to the classes and the engine pools them (the last token,
as HF does for an unpadded prompt), so each request's pooled vector is its class logits.
The front-end then applies the activation (:func:`apply_activation`) and names the labels.

A cross-encoder (a classification model with one label, such as a reranker) scores a pair of
texts by reading both as one sequence (:func:`cross_encoder_token_ids`); the score is the
sigmoid of that one logit (vLLM's default), instead of the cosine of two embeddings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: the activations a classifier's outputs may go through
ACTIVATIONS = ("softmax", "sigmoid", "identity")


def is_classification_architecture(architectures: Sequence[str]) -> bool:
    """Whether a checkpoint of ``architectures`` (``config.json``'s list) is a sequence
    classifier, which only a pooling engine runs: asked of the model class the registry holds
    for the first registered architecture (its ``is_sequence_classifier``); ``False`` when
    none is registered."""
    return bool(registered_model_attribute(architectures, "is_sequence_classifier", False))


def registered_model_attribute(architectures: Sequence[str], name: str, default: Any) -> Any:
    """Attribute ``name`` of the model class the registry holds for the first registered
    architecture of ``architectures``; ``default`` when none is registered (or the class
    lacks it)."""
    from chassis.plugins.registries import get_registries

    registry = get_registries().models
    for arch in architectures:
        if arch in registry:
            return getattr(registry.get(arch), name, default)
    return default


def resolve_runner(runner: str, architectures: Sequence[str]) -> str:
    """The runner an engine of ``architectures`` uses, as vLLM's ``--runner auto`` picks it:
    ``"pooling"`` for sequence classifiers, encoders (``is_encoder_only``: BERT,
    XLM-RoBERTa) and head-less decoders (``is_pooling_only``: bare ``MistralModel``,
    ``Qwen2Model``, ... checkpoints), ``"generate"`` otherwise; an explicit ``"generate"`` or
    ``"pooling"`` is kept. A classifier, an encoder or a head-less decoder asked to generate
    is a ``ValueError`` (it has no language-model head)."""
    classifier = is_classification_architecture(architectures)
    encoder = bool(registered_model_attribute(architectures, "is_encoder_only", False))
    headless = bool(registered_model_attribute(architectures, "is_pooling_only", False))
    if runner == "auto":
        return "pooling" if classifier or encoder or headless else "generate"
    if runner == "generate" and headless:
        raise ValueError(
            f"{', '.join(architectures)} is a decoder saved without its language-model head "
            "(an embedding model): it cannot generate text. Run it with runner='pooling' "
            "(--runner pooling, or leave the runner at 'auto') for embed(), score() and the "
            "/v1/embeddings, /pooling, /score and /rerank routes"
        )
    if runner == "generate" and encoder and not classifier:
        raise ValueError(
            f"{', '.join(architectures)} is an encoder-only (embedding) model: it cannot "
            "generate text. Run it with runner='pooling' (--runner pooling, or leave the "
            "runner at 'auto') for embed(), score() and the /v1/embeddings, /pooling, /score "
            "and /rerank routes"
        )
    if runner == "generate" and classifier:
        raise ValueError(
            f"{', '.join(architectures)} is a sequence-classification model: it cannot "
            "generate text. Run it with runner='pooling' (--runner pooling, or leave the "
            "runner at 'auto') for classify(), score() and the /classify, /score, /rerank "
            "and /pooling routes"
        )
    return runner


def _st_activation(hf_config: Any) -> str | None:
    """The activation a sentence-transformers ``CrossEncoder`` config names, as vLLM reads
    it (``sentence_transformers.activation_fn``, else ``sbert_ce_default_activation_function``);
    ``None`` when neither is set."""
    st = getattr(hf_config, "sentence_transformers", None)
    name = st.get("activation_fn") if isinstance(st, dict) else None
    name = name or getattr(hf_config, "sbert_ce_default_activation_function", None)
    if not name:
        return None
    leaf = str(name).rsplit(".", 1)[-1].lower()
    if leaf in ("identity", "sigmoid"):
        return leaf
    raise ValueError(
        f"the checkpoint's cross-encoder activation {name!r} is not supported "
        "(only torch.nn.Identity and torch.nn.Sigmoid)"
    )


@dataclass(frozen=True)
class ClassifierInfo:
    """What the front-end knows of a sequence classifier's outputs (from ``config.json``)."""

    num_labels: int
    #: the label of each class, in order (``id2label``; ``LABEL_i`` when absent)
    labels: tuple[str, ...]
    #: the ``classify`` activation (vLLM's, after HF's loss for the ``problem_type``):
    #: ``identity`` for regression, ``sigmoid`` for multi-label or a single label,
    #: ``softmax`` otherwise
    activation: str
    #: the score activation of a one-label cross-encoder: the checkpoint's
    #: sentence-transformers ``activation_fn`` when set, else ``sigmoid``
    score_activation: str

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> ClassifierInfo | None:
        """The classifier of ``hf_config``; ``None`` unless its architecture is a sequence
        classifier. Raises ``ValueError`` for a cross-encoder activation chassis lacks."""
        if not is_classification_architecture(getattr(hf_config, "architectures", None) or []):
            return None
        num_labels = int(getattr(hf_config, "num_labels", 0) or 0)
        if num_labels < 1:
            raise ValueError("a sequence-classification config needs num_labels >= 1")
        id2label = getattr(hf_config, "id2label", None) or {}
        labels = tuple(
            str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(num_labels)
        )
        problem_type = getattr(hf_config, "problem_type", None)
        if problem_type == "regression":
            activation = "identity"
        elif problem_type == "multi_label_classification" or num_labels < 2:
            activation = "sigmoid"
        else:
            activation = "softmax"
        return cls(num_labels, labels, activation, _st_activation(hf_config) or "sigmoid")

    def check_cross_encoder(self, model_name: str) -> None:
        """Raise ``ValueError`` unless the model scores pairs (one label, as vLLM asks)."""
        if self.num_labels != 1:
            raise ValueError(
                f'Model "{model_name}" is a classifier with {self.num_labels} labels; scoring '
                "pairs (score, rerank) needs a cross-encoder with num_labels == 1. Use "
                "classify() (/classify) for its class probabilities"
            )


def apply_activation(logits: Sequence[float], activation: str) -> list[float]:
    """``logits`` through ``activation`` (one of :data:`ACTIVATIONS`), in float32."""
    values = torch.tensor(list(logits), dtype=torch.float32)
    if activation == "softmax":
        values = torch.softmax(values, dim=-1)
    elif activation == "sigmoid":
        values = torch.sigmoid(values)
    elif activation != "identity":
        raise ValueError(f"unknown activation {activation!r}; known: {', '.join(ACTIVATIONS)}")
    return values.tolist()


@dataclass
class ClassificationOutput:
    """One prompt's class probabilities (vLLM's ``ClassificationOutput``): the logits after
    the activation, or the raw logits when it is turned off."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """The result of classifying one prompt, as vLLM's ``ClassificationRequestOutput``."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


def cross_encoder_token_ids(
    tokenizer: Any,
    first: str | list[int],
    second: str | list[int],
    truncate_to: int | None = None,
) -> list[int]:
    """The one sequence a cross-encoder reads for the pair (``first``, ``second``).

    Two texts are encoded as a pair by the tokenizer (``text_pair``: its special tokens and
    separators, as vLLM and sentence-transformers do), truncated by the tokenizer
    (``longest_first``) to ``truncate_to`` tokens when given. A tokenizer that cannot encode
    pairs gives the first text's tokens (with its special tokens) then the second's (without).
    Token-id inputs are concatenated (the caller truncates them). ``None`` for ``tokenizer``
    accepts token ids only (a ``ValueError`` for text).
    """
    if isinstance(first, str) and isinstance(second, str):
        if tokenizer is None:
            raise ValueError("text inputs need a tokenizer (this engine skipped loading one)")
        kwargs: dict[str, Any] = {}
        if truncate_to is not None:
            kwargs = {"truncation": True, "max_length": truncate_to}
        try:
            return list(tokenizer(text=first, text_pair=second, **kwargs).input_ids)
        except (TypeError, NotImplementedError):
            pass  # no pair encoding: the query, then the document
    return _ids(tokenizer, first, True) + _ids(tokenizer, second, False)


def _ids(tokenizer: Any, value: str | list[int], special: bool) -> list[int]:
    if isinstance(value, str):
        if tokenizer is None:
            raise ValueError("text inputs need a tokenizer (this engine skipped loading one)")
        return list(tokenizer(value, add_special_tokens=special).input_ids)
    return list(value)
