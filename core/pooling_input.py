"""Prompt -> validated pooling ``EngineCoreRequest`` (the front-end of ``runner="pooling"``).

The checks a client can act on happen here, before anything reaches the engine: the prompt
is tokenized (or its ids checked against the vocabulary), truncated when asked, must be
non-empty and fit ``max_model_len`` (a pooling prompt may fill the whole context: nothing is
generated after it), and ``dimensions`` must suit the model (Matryoshka).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chassis.core.input_processor import truncate_prompt
from chassis.core.pooling_classify import ClassifierInfo
from chassis.core.pooling_params import PoolingParams
from chassis.core.request import EngineCoreRequest
from chassis.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from chassis.core.input_processor import InputProcessor
    from chassis.core.lora.request import LoRARequest
    from chassis.core.pooling_config import PoolerConfig


@dataclass(frozen=True)
class EmbeddingModelInfo:
    """What the front-end knows of a pooling model's vectors."""

    #: the name errors use (the served name)
    model_name: str
    #: the length of a vector before truncation (the last Dense module's output size when
    #: the checkpoint has any)
    hidden_size: int
    #: whether the model was trained for Matryoshka truncation (``dimensions``)
    is_matryoshka: bool = False
    #: the only truncations the model supports, when it lists them
    matryoshka_dimensions: tuple[int, ...] | None = None
    #: set for a sequence classifier (its vectors are ``num_labels`` class logits)
    classifier: ClassifierInfo | None = None

    @classmethod
    def from_hf_config(
        cls, hf_config: Any, model_name: str, pooler: PoolerConfig | None = None
    ) -> EmbeddingModelInfo:
        """Read ``hidden_size`` and, as vLLM does, ``matryoshka_dimensions`` (a list) or
        ``is_matryoshka`` (a flag) from the model's ``config.json``; for a
        ``*ForSequenceClassification`` checkpoint, its classes
        (:class:`~chassis.core.pooling_classify.ClassifierInfo`), whose number is then the
        vectors' length. With the engine's ``pooler`` the vectors' length is its ``Dense``
        modules' output size when it has any."""
        dims = getattr(hf_config, "matryoshka_dimensions", None)
        classifier = ClassifierInfo.from_hf_config(hf_config)
        size = int(hf_config.hidden_size)
        if pooler is not None:
            size = pooler.embedding_size(size)
        return cls(
            model_name=model_name,
            hidden_size=size if classifier is None else classifier.num_labels,
            is_matryoshka=bool(dims) or bool(getattr(hf_config, "is_matryoshka", False)),
            matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None,
            classifier=classifier,
        )

    def check_dimensions(self, dimensions: int | None) -> None:
        """Raise ``ValueError`` unless ``dimensions`` (a request's) suits the model."""
        if dimensions is None:
            return
        if self.classifier is not None:
            raise ValueError(
                f'Model "{self.model_name}" is a classification model: its outputs are class '
                "logits, dimensions does not apply (omit it)."
            )
        if not self.is_matryoshka:
            raise ValueError(
                f'Model "{self.model_name}" does not support matryoshka representation, '
                "changing output dimensions will lead to poor results (omit dimensions)."
            )
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            raise ValueError(
                f'Model "{self.model_name}" only supports '
                f"{list(self.matryoshka_dimensions)} matryoshka dimensions; got {dimensions}."
            )
        if dimensions > self.hidden_size:
            raise ValueError(
                f"dimensions {dimensions} exceeds the model's embedding size {self.hidden_size}"
            )


def process_pooling(
    input_processor: InputProcessor,
    info: EmbeddingModelInfo,
    prompt: str | list[int],
    params: PoolingParams,
    request_id: str,
    priority: int = 0,
    arrival_time: float | None = None,
    *,
    add_special_tokens: bool = True,
    lora_request: LoRARequest | None = None,
) -> EngineCoreRequest:
    """Validate one pooling request and return what to send to the engine core.

    ``prompt`` is text (tokenized with ``input_processor``'s tokenizer, special tokens
    included unless ``add_special_tokens=False``) or token ids. ``lora_request`` names the
    LoRA adapter to pool with (``None``: the base model), checked as for generation
    (:meth:`~chassis.core.input_processor.InputProcessor.check_lora`: LoRA on, the id not
    given to another adapter, the adapter fits the model; its first check reads its files).
    Every rejection is a ``ValueError`` whose message a client can act on.
    """
    if not isinstance(params, PoolingParams):
        raise ValueError(f"pooling_params must be a PoolingParams; got {params!r}")
    priority = input_processor.check_priority(priority)
    info.check_dimensions(params.dimensions)
    ids = input_processor.token_ids(prompt, add_special_tokens=add_special_tokens)
    max_len = input_processor.max_model_len
    # -1: the last max_len; above max_len: refused whatever the input's length (vLLM's rule)
    ids = truncate_prompt(ids, params.truncate_prompt_tokens, max_len)
    if not ids:
        raise ValueError("the input is empty: it must contain at least one token")
    vocab = input_processor.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"input token ids out of the vocabulary [0, {vocab}): {bad[:10]}")
    if len(ids) > max_len:  # (not truncated: a truncation keeps at most max_len)
        raise ValueError(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{len(ids)} tokens in the input for embedding generation. Please reduce the length "
            "of the input (or set truncate_prompt_tokens)."
        )
    input_processor.check_lora(lora_request)
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=ids,
        # not read for a pooling request (the request types stay one, vLLM's shape)
        sampling_params=SamplingParams(max_tokens=1),
        arrival_time=time.time() if arrival_time is None else arrival_time,
        priority=priority,
        pooling_params=params,
        # its prefix-cache entries chain from the adapter's id, as a generate request's do
        lora_request=lora_request,
    )
