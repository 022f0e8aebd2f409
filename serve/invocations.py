"""``POST /invocations``: one route for every request kind (Amazon SageMaker's contract, which
vLLM serves too; SageMaker probes ``/ping``, served beside ``/health`` in :mod:`chassis.serve.app`).

The body is a request of one of the server's own APIs, answered exactly as that route
answers it (streamed when it asks to be). Which API is read from the body's keys, for the
kind of model served:

* a generating model: ``messages`` -> ``/v1/chat/completions``, else ``prompt`` ->
  ``/v1/completions``;
* a pooling model: ``query`` with ``documents`` -> ``/rerank``, ``text_1`` or ``text_2`` ->
  ``/score``, else ``input`` or ``messages`` -> ``/classify`` for a sequence-classification
  model and ``/v1/embeddings`` for an embedding model.

A body that fits none is a 400 naming what each kind takes (vLLM's message is "Cannot find
suitable handler for request"); a body that fits one but is invalid for it gets that route's
400 (its field errors).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from chassis.serve import errors
from chassis.serve.openai_chat import create_chat_completion
from chassis.serve.openai_classify import ClassificationRequest, create_classify
from chassis.serve.openai_completions import create_completion
from chassis.serve.openai_embeddings import EmbeddingRequest, create_embedding
from chassis.serve.openai_score import RerankRequest, ScoreRequest, create_score, do_rerank
from chassis.serve.protocol import ChatCompletionRequest, CompletionRequest

router = APIRouter()

Handler = Callable[[Any, Request], Awaitable[Response]]

#: what the error says each kind of server takes
_GENERATING = "a chat completion request (with 'messages') or a completion request (with 'prompt')"
_POOLING = (
    "an embeddings or classification request (with 'input' or 'messages'), a score request "
    "(with 'text_1' and 'text_2') or a rerank request (with 'query' and 'documents')"
)


def invocation_route(
    body: dict[str, Any], pooling: bool, classifier: bool
) -> tuple[type[BaseModel], Handler] | None:
    """The request model and handler (a route's) that ``body`` is for (see the module docstring),
    or ``None`` when its keys fit no API of this kind of server."""
    if not pooling:
        if "messages" in body:
            return ChatCompletionRequest, create_chat_completion
        if "prompt" in body or "prompt_embeds" in body:
            return CompletionRequest, create_completion
        return None
    if "query" in body and "documents" in body:
        return RerankRequest, do_rerank
    if "text_1" in body or "text_2" in body:
        return ScoreRequest, create_score
    if "input" in body or "messages" in body:
        if classifier:
            return ClassificationRequest, create_classify
        return EmbeddingRequest, create_embedding
    return None


@router.post("/invocations")
async def invocations(request: Request) -> Response:
    """Answer the body as the route its keys select (see the module docstring)."""
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as exc:
        raise errors.bad_request(f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise errors.bad_request("the request body must be a JSON object")
    engine = request.app.state.chassis.engine
    pooling = getattr(engine, "pooler_config", None) is not None
    classifier = getattr(getattr(engine, "embedding_info", None), "classifier", None) is not None
    route = invocation_route(body, pooling, classifier)
    if route is None:
        kind = "pooling" if pooling else "text generation"
        wanted = _POOLING if pooling else _GENERATING
        raise errors.bad_request(
            f"cannot tell which API this /invocations request is for: a server of a {kind} "
            f"model takes {wanted}"
        )
    model, handler = route
    try:
        parsed = model.model_validate(body)
    except ValidationError as exc:
        # the route's own 400, naming the invalid fields (errors.validation_error_to_api_error)
        raise RequestValidationError(exc.errors(include_url=False)) from None
    return await handler(parsed, request)
