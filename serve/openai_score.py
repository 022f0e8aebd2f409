"""vLLM's score and rerank routes, for embedding models and cross-encoders.

Embedding models (bi-encoder scoring): a score is the cosine similarity of two texts'
embeddings (:mod:`chassis.core.pooling_score`); each distinct text of a request is embedded
once through the embeddings path (:mod:`chassis.serve.openai_embeddings`). Sequence
classifiers with one label (cross-encoders, rerankers): each pair is read as one sequence
(the tokenizer's pair encoding, :func:`~chassis.core.pooling_classify.cross_encoder_token_ids`)
and its logit goes through the model's score activation (sigmoid unless the checkpoint names
another; ``use_activation: false``: the raw logit); a classifier with more labels is a 400.
The routes need a pooling server and answer 400 on a generating one. ``model`` names the
base model or a LoRA adapter (every text or pair is then computed with it), as on the
generation routes; any other name is a 404.

* ``POST /score``, ``/v1/score``: ``text_1`` and ``text_2`` (a string or a list of strings),
  paired 1:1, 1:N or N:N; ``data`` holds one score per pair, in order.
* ``POST /rerank``, ``/v1/rerank``, ``/v2/rerank`` (Jina/Cohere style): ``query`` against each
  of ``documents``; ``results`` best first, the first ``top_n`` (absent, 0 or negative: all,
  as vLLM), each with its document's ``index`` and, unless ``return_documents`` is false, its
  text.

Both take vLLM's ``truncate_prompt_tokens`` (for a cross-encoder: the pair's tokens, cut by
the tokenizer's pair truncation), ``priority`` and ``use_activation`` (cross-encoders only).
``usage`` counts each pair's tokens (bi-encoders: first text, the tokenizer's pad token if
it has one, then second, as vLLM does: a query scored against N documents counts N times,
though it is computed once; cross-encoders: the pair's sequence).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from chassis.core.input_processor import truncation_length
from chassis.core.pooling_classify import apply_activation, cross_encoder_token_ids
from chassis.core.pooling_score import (
    ScoringOutput,
    ScoringRequestOutput,
    distinct,
    score_outputs,
    score_pairs,
)
from chassis.serve import errors
from chassis.serve.lone_surrogates import refuse_lone_surrogates
from chassis.serve.openai_classify import activation_for, classifier_params
from chassis.serve.openai_embeddings import (
    MAX_EMBEDDING_INPUTS,
    EmbeddingRequest,
    embed_all,
    tokenized_inputs,
)
from chassis.serve.streaming import generation_response, never_streamed

if TYPE_CHECKING:
    from chassis.core.lora.request import LoRARequest
    from chassis.core.pooling_classify import ClassifierInfo
    from chassis.serve.state import ServerState

logger = logging.getLogger(__name__)

router = APIRouter()

#: builds a route's answer from the scored pairs, the request id and the served model name
Answer = Callable[[list[ScoringRequestOutput], str, str], BaseModel]


class _PairRequest(BaseModel):
    """What both routes take besides their texts; unknown fields are logged and ignored."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _refuse_lone_surrogates(cls, data: Any) -> Any:
        """A 400 naming the field whose text holds a lone surrogate (serve/lone_surrogates.py)."""
        return refuse_lone_surrogates(data)

    model: str | None = None
    #: keep each text's last k tokens (-1: the last max_model_len; above it: a 400)
    truncate_prompt_tokens: int | None = None
    priority: int | None = Field(0, ge=-(2**63), le=2**63 - 1)
    #: a cross-encoder's score activation (None: the server's pooler config, on by default);
    #: ignored for embedding models
    use_activation: bool | None = None

    @model_validator(mode="after")
    def _warn_unknown_fields(self) -> _PairRequest:
        if self.model_extra:
            logger.warning(
                "ignoring unknown fields in %s: %s",
                type(self).__name__,
                ", ".join(sorted(self.model_extra)),
            )
        return self


class ScoreRequest(_PairRequest):
    """vLLM's score request: ``text_1`` against ``text_2`` (1:1, 1:N or N:N)."""

    text_1: str | list[str]
    text_2: str | list[str]


class ScoreResponseData(BaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreResponse(BaseModel):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreResponseData]
    usage: ScoreUsage


class RerankRequest(_PairRequest):
    """The Jina/Cohere rerank request vLLM takes: ``query`` against each of ``documents``."""

    query: str
    documents: list[str]
    #: how many results to return, best first (None, 0 or negative: all, as vLLM)
    top_n: int | None = None
    #: include each document's text in its result (vLLM always does)
    return_documents: bool | None = True


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    #: the document's text (null when ``return_documents`` is false)
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def _state(request: Request) -> ServerState:
    return request.app.state.chassis


def _check_texts(texts: list[str], field: str) -> None:
    """A 400 naming ``field`` for an empty text (it has no embedding)."""
    if any(not text for text in texts):
        raise errors.bad_request(f"{field} must not contain empty strings", field)


def _check_pooling_server(state: ServerState, what: str) -> None:
    """A 400 (as /v1/embeddings gives) unless the server runs a pooling engine."""
    if getattr(state.engine, "pooler_config", None) is None:
        raise errors.bad_request(
            f"The model '{state.model_name}' is served for text generation and does not "
            f"support {what}; serve an embedding model with --runner pooling (scores are the "
            "cosine of the texts' embeddings) or a one-label *ForSequenceClassification "
            "cross-encoder",
            "model",
        )


async def _scores(
    request: Request,
    body: _PairRequest,
    firsts: list[str],
    seconds: list[str],
    prefix: str,
    answer: Answer,
) -> Response:
    """Embed every distinct text of ``firsts`` and ``seconds`` (as one embeddings request),
    score each pair, and answer ``answer(scored pairs, request_id, model)``; ``prefix``
    (``score`` or ``rerank``) starts the request id."""
    state = _state(request)
    state.check_accepting()
    model, lora_request = state.resolve_model(body.model)
    _check_pooling_server(state, prefix)
    try:
        pairs = score_pairs(len(firsts), len(seconds))
    except ValueError as exc:
        raise errors.bad_request(str(exc), "text_1" if not firsts else "text_2") from None
    classifier = getattr(state.engine.embedding_info, "classifier", None)
    if classifier is not None:
        return await _cross_encoder_scores(
            request,
            state,
            body,
            [(firsts[i], seconds[j]) for i, j in pairs],
            prefix,
            answer,
            (model, lora_request),
        )
    unique, where = distinct(firsts + seconds, firsts + seconds)
    if len(unique) > MAX_EMBEDDING_INPUTS:
        raise errors.bad_request(
            f"{len(unique)} distinct texts in one request; at most {MAX_EMBEDDING_INPUTS} are "
            "accepted: split the request",
            None,
        )
    embed_body = EmbeddingRequest(
        input=unique, truncate_prompt_tokens=body.truncate_prompt_tokens, priority=body.priority
    )
    params = embed_body.pooling_params(state.max_model_len)
    request_id = f"{prefix}-{uuid.uuid4().hex}"

    async def inputs() -> list[str | list[int]]:
        return await tokenized_inputs(state, embed_body)

    async def collect(prompts: list[str | list[int]]) -> BaseModel:
        embeddings = await embed_all(
            state, prompts, params, request_id, body.priority or 0, lora_request
        )
        offset = len(firsts)
        scored = score_outputs(
            [(embeddings[where[i]], embeddings[where[offset + j]]) for i, j in pairs],
            getattr(state.tokenizer, "pad_token_id", None),
        )
        return answer(scored, request_id, model)

    return await generation_response(request, False, inputs, never_streamed, collect)


async def _cross_encoder_scores(
    request: Request,
    state: ServerState,
    body: _PairRequest,
    pairs: list[tuple[str, str]],
    prefix: str,
    answer: Answer,
    resolved: tuple[str, LoRARequest | None],
) -> Response:
    """Score each pair as one sequence through the served one-label classifier (with the
    LoRA adapter of ``resolved``, ``(model name, adapter or None)``) and answer
    ``answer(scored pairs, request_id, model)``."""
    model, lora_request = resolved
    classifier: ClassifierInfo = state.engine.embedding_info.classifier
    try:
        classifier.check_cross_encoder(state.model_name)
    except ValueError as exc:
        raise errors.bad_request(str(exc), "model") from None
    if len(pairs) > MAX_EMBEDDING_INPUTS:
        raise errors.bad_request(
            f"{len(pairs)} pairs in one request; at most {MAX_EMBEDDING_INPUTS} are accepted: "
            "split the request",
            None,
        )
    params = classifier_params(body.truncate_prompt_tokens, state.max_model_len)
    keep = None
    if state.max_model_len is not None:
        keep = truncation_length(params.truncate_prompt_tokens, state.max_model_len)
    activation = activation_for(state, classifier.score_activation, body.use_activation)
    request_id = f"{prefix}-{uuid.uuid4().hex}"

    async def inputs() -> list[str | list[int]]:
        def tokenize() -> list[str | list[int]]:
            return [cross_encoder_token_ids(state.tokenizer, a, b, keep) for a, b in pairs]

        return await asyncio.to_thread(tokenize)

    async def collect(prompts: list[str | list[int]]) -> BaseModel:
        outputs = await embed_all(
            state, prompts, params, request_id, body.priority or 0, lora_request
        )
        scored = [
            ScoringRequestOutput(
                request_id=out.request_id,
                outputs=ScoringOutput(apply_activation(out.outputs.embedding, activation)[0]),
                prompt_token_ids=list(out.prompt_token_ids),
            )
            for out in outputs
        ]
        return answer(scored, request_id, model)

    return await generation_response(request, False, inputs, never_streamed, collect)


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


@router.post("/score", response_model=ScoreResponse)
@router.post("/v1/score", response_model=ScoreResponse)
async def create_score(body: ScoreRequest, request: Request) -> Response:
    """vLLM's score API (see the module docstring)."""
    firsts, seconds = _as_list(body.text_1), _as_list(body.text_2)
    _check_texts(firsts, "text_1")
    _check_texts(seconds, "text_2")

    def answer(scored: list[ScoringRequestOutput], request_id: str, model: str) -> ScoreResponse:
        num_tokens = sum(len(out.prompt_token_ids) for out in scored)
        return ScoreResponse(
            id=request_id,
            model=model,
            data=[
                ScoreResponseData(index=i, score=out.outputs.score) for i, out in enumerate(scored)
            ],
            usage=ScoreUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )

    return await _scores(request, body, firsts, seconds, "score", answer)


@router.post("/rerank", response_model=RerankResponse)
@router.post("/v1/rerank", response_model=RerankResponse)
@router.post("/v2/rerank", response_model=RerankResponse)
async def do_rerank(body: RerankRequest, request: Request) -> Response:
    """Jina/Cohere-style rerank (see the module docstring)."""
    if not body.documents:
        raise errors.bad_request("documents must not be empty", "documents")
    _check_texts([body.query], "query")
    _check_texts(body.documents, "documents")

    def answer(scored: list[ScoringRequestOutput], request_id: str, model: str) -> RerankResponse:
        results = [
            RerankResult(
                index=i,
                document=RerankDocument(text=body.documents[i])
                if body.return_documents is not False
                else None,
                relevance_score=out.outputs.score,
            )
            for i, out in enumerate(scored)
        ]
        # best first; equal scores keep the documents' order (a stable sort)
        results.sort(key=lambda r: r.relevance_score, reverse=True)
        if body.top_n is not None and body.top_n > 0:
            results = results[: body.top_n]
        num_tokens = sum(len(out.prompt_token_ids) for out in scored)
        return RerankResponse(
            id=request_id,
            model=model,
            usage=RerankUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
            results=results,
        )

    return await _scores(request, body, [body.query], body.documents, "rerank", answer)
