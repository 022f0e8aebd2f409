"""vLLM's ``POST /classify`` and ``POST /pooling`` routes, served by a pooling engine.

* ``/classify`` (sequence-classification models, ``*ForSequenceClassification``): ``input``
  is a string, a list of strings, a list of token ids or a list of lists of them; each
  input's ``probs`` are the class logits through the model's activation (softmax; sigmoid
  for one label or multi-label models) unless ``use_activation`` (older vLLM: ``activation``,
  ``softmax``) is false, ``label`` the ``id2label`` name of the largest. Other models: 400.
* ``/pooling``: each input's pooled vector, as it leaves the engine: an embedding model's
  embedding (``normalize``/``use_activation`` and ``dimensions`` as on ``/v1/embeddings``);
  a classifier's class logits through its activation (raw logits with ``use_activation:
  false``). ``encoding_format`` ``"base64"``, ``"bytes"`` and ``"bytes_only"`` (with
  ``embed_dtype`` and ``endianness``) as on ``/v1/embeddings``, as vLLM serves them here;
  ``/classify`` answers JSON only (the bytes formats are a 400 there).

Both take vLLM's ``truncate_prompt_tokens``, ``add_special_tokens`` and ``priority``, and
``messages`` (a chat conversation) instead of ``input`` as ``/v1/embeddings`` does; inputs
are validated and batched as on ``/v1/embeddings`` (:mod:`chassis.serve.openai_embeddings`),
and a generating server answers 400; ``model`` names the base model or a LoRA adapter, as
there. Uses the engine contract described there, plus
``engine.embedding_info.classifier`` (:class:`~chassis.core.pooling_classify.ClassifierInfo`
or ``None``) and ``engine.pooler_config.use_activation``.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from chassis.core.pooling_classify import apply_activation
from chassis.core.pooling_params import PoolingParams
from chassis.serve import errors
from chassis.serve.embedding_encoding import BINARY_FORMATS
from chassis.serve.openai_embeddings import (
    EmbeddingRequest,
    binary,
    embed_all,
    encoded,
    tokenized_inputs,
)
from chassis.serve.streaming import generation_response, never_streamed

if TYPE_CHECKING:
    from chassis.core.lora.request import LoRARequest
    from chassis.core.pooling_classify import ClassifierInfo
    from chassis.core.pooling_outputs import EmbeddingRequestOutput
    from chassis.serve.state import ServerState

logger = logging.getLogger(__name__)

router = APIRouter()


class _PoolingRouteRequest(EmbeddingRequest):
    """The fields ``/classify`` and ``/pooling`` share with ``/v1/embeddings``, plus vLLM's
    older names of ``use_activation``."""

    #: older vLLM names of ``use_activation`` (a classifier's activation)
    activation: bool | None = None
    softmax: bool | None = None

    def activation_flag(self) -> bool | None:
        """``use_activation`` or one of its older names; a 400 when they disagree."""
        given = {
            name: value
            for name, value in (
                ("use_activation", self.use_activation),
                ("activation", self.activation),
                ("softmax", self.softmax),
            )
            if value is not None
        }
        if len(set(given.values())) > 1:
            raise errors.bad_request(
                f"{' and '.join(given)} disagree; send use_activation only", "use_activation"
            )
        return next(iter(given.values()), None)


class ClassificationRequest(_PoolingRouteRequest):
    """vLLM's classification request (``model``, ``input``, ``truncate_prompt_tokens``,
    ``use_activation``, ``add_special_tokens``, ``priority``)."""


class ClassificationData(BaseModel):
    index: int
    #: the ``id2label`` name of the most probable class
    label: str | None
    probs: list[float]
    num_classes: int


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ClassificationResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


class PoolingRequest(_PoolingRouteRequest):
    """vLLM's pooling request: the embeddings request's fields (``encoding_format``,
    ``dimensions``, ``normalize`` for embedding models) and ``use_activation``."""


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    #: the vector, or (``encoding_format: "base64"``) the base64 of its ``embed_dtype`` bytes
    data: list[float] | str


class PoolingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: PoolingUsage


def _state(request: Request) -> ServerState:
    return request.app.state.chassis


def _check_pooling_server(state: ServerState, route: str) -> None:
    if getattr(state.engine, "pooler_config", None) is None:
        raise errors.bad_request(
            f"The model '{state.model_name}' is served for text generation and does not "
            f"support {route}; serve a pooling model (--runner pooling, or a "
            "*ForSequenceClassification checkpoint with the default --runner auto)",
            "model",
        )


def _classifier(state: ServerState) -> ClassifierInfo | None:
    info = getattr(state.engine, "embedding_info", None)
    return getattr(info, "classifier", None)


def activation_for(state: ServerState, activation: str, flag: bool | None) -> str:
    """``activation`` (a classifier's, or its score activation) unless the request's
    ``use_activation`` (``flag``; ``None``: the server's pooler config) turns it off."""
    use = state.engine.pooler_config.use_activation if flag is None else flag
    return activation if use else "identity"


def classifier_params(
    truncate_prompt_tokens: int | None, max_model_len: int | None
) -> PoolingParams:
    """A classifier request's params (also a cross-encoder's): its truncation, checked as on
    ``/v1/embeddings`` (a 400 naming ``truncate_prompt_tokens``), never normalized (the
    outputs are class logits)."""
    checked = EmbeddingRequest(input="-", truncate_prompt_tokens=truncate_prompt_tokens)
    return checked.pooling_params(max_model_len).clone(normalize=False)


def _classifier_params(body: _PoolingRouteRequest, max_model_len: int | None) -> PoolingParams:
    """:func:`classifier_params` of ``body``; a 400 for the embedding-only fields."""
    if body.normalize is not None:
        raise errors.bad_request(
            "normalize applies to embedding models; this model is a classifier (use "
            "use_activation to turn its activation off)",
            "normalize",
        )
    if body.dimensions is not None:
        raise errors.bad_request(
            "dimensions applies to embedding models; this model is a classifier", "dimensions"
        )
    return classifier_params(body.truncate_prompt_tokens, max_model_len)


def _usage(outputs: list[EmbeddingRequestOutput]) -> PoolingUsage:
    num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)


async def _run(
    request: Request,
    state: ServerState,
    body: _PoolingRouteRequest,
    params: PoolingParams,
    request_id: str,
    answer: Any,
    lora_request: LoRARequest | None,
) -> Response:
    """Tokenize ``body``'s inputs, pool them all with ``params`` (and the LoRA adapter
    ``lora_request``, ``None``: the base model) and answer ``answer(outputs)`` (a pydantic
    body, or a ready ``Response``)."""

    async def inputs() -> list[str | list[int]]:
        return await tokenized_inputs(state, body)

    async def collect(prompts: list[str | list[int]]) -> BaseModel | Response:
        outputs = await embed_all(
            state, prompts, params, request_id, body.priority or 0, lora_request
        )
        return answer(outputs)

    return await generation_response(request, False, inputs, never_streamed, collect)


@router.post("/classify", response_model=ClassificationResponse)
async def create_classify(body: ClassificationRequest, request: Request) -> Response:
    """vLLM's classification API (see the module docstring)."""
    state = _state(request)
    state.check_accepting()
    model, lora_request = state.resolve_model(body.model)
    _check_pooling_server(state, "/classify")
    classifier = _classifier(state)
    if classifier is None:
        raise errors.bad_request(
            f"The model '{state.model_name}' is an embedding model and does not support "
            "classification; /classify needs a *ForSequenceClassification model (use "
            "/v1/embeddings or /pooling)",
            "model",
        )
    if body.encoding_format in BINARY_FORMATS:
        raise errors.bad_request(
            f"encoding_format {body.encoding_format!r} is served on /v1/embeddings and "
            "/pooling; /classify answers JSON (labels and probabilities)",
            "encoding_format",
        )
    activation = activation_for(state, classifier.activation, body.activation_flag())
    params = _classifier_params(body, state.max_model_len)
    request_id = f"classify-{uuid.uuid4().hex}"

    def answer(outputs: list[EmbeddingRequestOutput]) -> ClassificationResponse:
        data = []
        for i, out in enumerate(outputs):
            probs = apply_activation(out.outputs.embedding, activation)
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(
                ClassificationData(
                    index=i, label=classifier.labels[best], probs=probs, num_classes=len(probs)
                )
            )
        return ClassificationResponse(id=request_id, model=model, data=data, usage=_usage(outputs))

    return await _run(request, state, body, params, request_id, answer, lora_request)


@router.post("/pooling", response_model=PoolingResponse)
async def create_pooling(body: PoolingRequest, request: Request) -> Response:
    """vLLM's pooling API (see the module docstring)."""
    state = _state(request)
    state.check_accepting()
    model, lora_request = state.resolve_model(body.model)
    _check_pooling_server(state, "/pooling")
    classifier = _classifier(state)
    activation = "identity"
    if classifier is None:
        params = body.pooling_params(state.max_model_len)  # use_activation: normalize
        try:
            state.engine.embedding_info.check_dimensions(params.dimensions)
        except ValueError as exc:
            raise errors.bad_request(str(exc), "dimensions") from None
    else:
        activation = activation_for(state, classifier.activation, body.activation_flag())
        params = _classifier_params(body, state.max_model_len)
    request_id = f"pool-{uuid.uuid4().hex}"

    def answer(outputs: list[EmbeddingRequestOutput]) -> PoolingResponse | Response:
        vectors = [
            out.outputs.embedding  # exactly the engine's float32 values
            if classifier is None
            else apply_activation(out.outputs.embedding, activation)
            for out in outputs
        ]
        if body.encoding_format in BINARY_FORMATS:  # as on /v1/embeddings
            return binary(body, vectors, outputs, request_id, model)
        # base64: embed_dtype and endianness as on /v1/embeddings
        data = [PoolingData(index=i, data=encoded(body, v)) for i, v in enumerate(vectors)]
        return PoolingResponse(id=request_id, model=model, data=data, usage=_usage(outputs))

    return await _run(request, state, body, params, request_id, answer, lora_request)
