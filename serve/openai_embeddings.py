"""``POST /v1/embeddings``: OpenAI's embeddings API, served by a pooling engine.

Needs ``chassis serve MODEL --runner pooling``; a generating server answers 400 (and a
pooling server refuses completions and chat with 400). ``input`` is a string, a list of
strings, a list of token ids or a list of lists of token ids; each is one engine request, all
run concurrently (batched by the scheduler). Text is tokenized in a worker thread, with the
tokenizer's special tokens unless ``add_special_tokens`` is false. ``encoding_format``
``"base64"`` gives each vector as the base64 of its bytes (by default float32 in the server's
byte order, little-endian on the usual hosts: what the ``openai`` client asks for by default
and decodes). ``dimensions`` truncates the vector
(then normalizes it) only for models trained for it (Matryoshka: ``matryoshka_dimensions`` or
``is_matryoshka`` in ``config.json``); otherwise it is refused. Besides OpenAI's fields the
request takes vLLM's ``truncate_prompt_tokens``, ``add_special_tokens``, ``normalize`` (or
its newer name ``use_activation``) and ``priority``, and vLLM's ``embed_dtype``,
``endianness`` and ``encoding_format`` ``"bytes"`` and ``"bytes_only"``
(:mod:`chassis.serve.embedding_encoding`).

Instead of ``input``, vLLM's chat-style request sends ``messages``: the conversation is
rendered with the chat template as ``/v1/chat/completions`` renders it
(:class:`~chassis.serve.renderer.ChatRenderer`; ``add_generation_prompt`` defaults to false
here, ``continue_final_message``, ``chat_template_kwargs``), tokenized without special tokens
unless ``add_special_tokens`` is true, and embedded as one input. A template sent with the
request (``chat_template``, or ``chat_template`` in ``chat_template_kwargs``) replaces the
server's only when it runs with ``--trust-request-chat-template``; otherwise it is a 400, as
in vLLM.

Every input is one engine request, counted in the server's per-request metrics
(:meth:`chassis.serve.metrics.ServerMetrics.observe_pooled`).

``model`` selects the base model or a LoRA adapter by name (``--lora-modules``, adapters
loaded at run time), as on the generation routes; any other name is a 404.

Beyond the engine contract of :mod:`chassis.serve.state`, this route uses::

    engine.pooler_config      # None for a generating engine (the route then answers 400)
    engine.embedding_info     # EmbeddingModelInfo: check_dimensions(dimensions) -> ValueError
    engine.encode(prompt, pooling_params, request_id, *, priority=0)
        # -> AsyncIterator[EmbeddingRequestOutput], one finished output; ValueError for bad
        # input; closing it early aborts the request; and lora_request=LoRARequest, passed
        # only for a request naming an adapter
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from chassis.core.input_processor import truncation_length
from chassis.core.pooling_params import PoolingParams
from chassis.serve import errors
from chassis.serve.embedding_encoding import (
    BINARY_FORMATS,
    EmbedDType,
    EncodingFormat,
    Endianness,
    bytes_body,
    encode_vector,
)
from chassis.serve.lone_surrogates import refuse_lone_surrogates
from chassis.serve.protocol import ChatMessage
from chassis.serve.streaming import generation_response, never_streamed

if TYPE_CHECKING:
    from chassis.core.lora.request import LoRARequest
    from chassis.core.pooling_outputs import EmbeddingRequestOutput
    from chassis.serve.state import ServerState

logger = logging.getLogger(__name__)

router = APIRouter()

#: OpenAI's limit on the inputs of one request (each is an engine request created at once)
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request, plus vLLM's extra fields (its ``EmbeddingCompletionRequest``
    and, with ``messages`` instead of ``input``, its ``EmbeddingChatRequest``); unknown fields
    are logged and ignored (as on the other routes)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _refuse_lone_surrogates(cls, data: Any) -> Any:
        """A 400 naming the field whose text holds a lone surrogate (serve/lone_surrogates.py)."""
        return refuse_lone_surrogates(data)

    model: str | None = None
    #: exactly one of ``input`` and ``messages`` (:meth:`check_input`)
    input: str | list[str] | list[int] | list[list[int]] | None = None
    encoding_format: EncodingFormat | None = "float"
    dimensions: int | None = None
    user: str | None = None
    # -- vLLM extra fields ------------------------------------------------------------------
    #: keep each input's last k tokens (-1: the last max_model_len; above it: a 400)
    truncate_prompt_tokens: int | None = None
    #: None: true for ``input``, false for ``messages`` (the chat template writes BOS)
    add_special_tokens: bool | None = None
    #: the type ``base64`` and the bytes formats encode each value as (``float``: float32)
    embed_dtype: EmbedDType = "float32"
    #: the byte order of ``base64`` and the bytes formats (``native``: the server's)
    endianness: Endianness = "native"
    #: vLLM's chat-style input: one conversation, rendered with the chat template
    messages: list[ChatMessage] | None = None
    #: the request's own chat template (its text): a 400 unless the server runs with
    #: --trust-request-chat-template, as in vLLM
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = False
    continue_final_message: bool | None = False
    #: L2-normalize (None: the server's pooler config)
    normalize: bool | None = None
    #: newer vLLM's name for ``normalize`` (an embedding's "activation" is its normalization)
    use_activation: bool | None = None
    priority: int | None = Field(0, ge=-(2**63), le=2**63 - 1)

    @model_validator(mode="after")
    def _warn_unknown_fields(self) -> EmbeddingRequest:
        if self.model_extra:
            logger.warning(
                "ignoring unknown fields in EmbeddingRequest: %s",
                ", ".join(sorted(self.model_extra)),
            )
        return self

    def check_input(self) -> None:
        """A 400 unless exactly one of ``input`` and ``messages`` is given, and for
        ``add_generation_prompt`` with ``continue_final_message``. (A request's own
        ``chat_template`` is checked by the renderer: a 400 unless the server runs with
        ``--trust-request-chat-template``.)"""
        if (self.input is None) == (self.messages is None):
            raise errors.bad_request(
                "give exactly one of 'input' (texts or token ids) or 'messages' (a chat "
                "conversation, rendered with the chat template)",
                "messages" if self.messages is not None else "input",
            )
        if self.messages is None:
            return
        if not self.messages:
            raise errors.bad_request("messages must not be empty", "messages")
        if self.add_generation_prompt and self.continue_final_message:
            raise errors.bad_request(
                "add_generation_prompt and continue_final_message cannot both be true",
                "continue_final_message",
            )

    def inputs(self) -> list[str | list[int]]:
        """The batch of inputs; a 400 for an empty batch, an empty input or too many."""
        value = self.input
        if value is None:
            raise errors.bad_request("input is required", "input")
        if isinstance(value, str):
            batch: list[str | list[int]] = [value]
        elif not value:
            raise errors.bad_request("input must not be empty", "input")
        elif isinstance(value[0], int):
            batch = [list(value)]  # type: ignore[arg-type]
        else:
            batch = list(value)  # type: ignore[arg-type]
        if any(len(item) == 0 for item in batch):
            raise errors.bad_request("input must not contain empty strings or lists", "input")
        if len(batch) > MAX_EMBEDDING_INPUTS:
            raise errors.bad_request(
                f"{len(batch)} inputs in one request; at most {MAX_EMBEDDING_INPUTS} are "
                "accepted: split the batch over several requests",
                "input",
            )
        return batch

    def pooling_params(self, max_model_len: int | None = None) -> PoolingParams:
        """The request's :class:`PoolingParams` (a 400 naming the field when invalid);
        ``max_model_len`` (the served model's, when known) bounds ``truncate_prompt_tokens``
        as vLLM does: a larger value is a 400 whatever the input's length."""
        normalize = self.normalize
        if self.use_activation is not None:
            if normalize is not None and normalize != self.use_activation:
                raise errors.bad_request(
                    "normalize and use_activation (vLLM's newer name for it) disagree; "
                    "send one of them",
                    "use_activation",
                )
            normalize = self.use_activation
        try:
            params = PoolingParams(
                dimensions=self.dimensions,
                normalize=normalize,
                truncate_prompt_tokens=self.truncate_prompt_tokens,
            )
        except ValueError as exc:
            message = str(exc)
            param = next(
                (f for f in ("dimensions", "truncate_prompt_tokens", "normalize") if f in message),
                None,
            )
            raise errors.bad_request(message, param) from None
        if max_model_len is not None:
            try:
                truncation_length(params.truncate_prompt_tokens, max_model_len)
            except ValueError as exc:
                raise errors.bad_request(str(exc), "truncate_prompt_tokens") from None
        return params


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    #: the vector, or (``encoding_format: "base64"``) the base64 of its ``embed_dtype`` bytes
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def _state(request: Request) -> ServerState:
    return request.app.state.chassis


async def tokenized_inputs(state: ServerState, body: EmbeddingRequest) -> list[str | list[int]]:
    """The inputs with text tokenized (in a worker thread). Without a tokenizer
    (``--skip-tokenizer-init``) text goes on as is and the engine refuses it with a 400.
    ``messages``: the one conversation, rendered and tokenized as the chat route does."""
    body.check_input()
    if body.messages is not None:
        if state.tokenizer is None:
            raise errors.bad_request(
                "messages need the tokenizer and its chat template; this server runs with "
                "--skip-tokenizer-init: send token ids as input",
                "messages",
            )
        ids = await asyncio.to_thread(
            state.renderer.render_ids,
            body.messages,
            add_generation_prompt=bool(body.add_generation_prompt),
            continue_final_message=bool(body.continue_final_message),
            chat_template_kwargs=body.chat_template_kwargs,
            chat_template=body.chat_template,
            add_special_tokens=bool(body.add_special_tokens),
        )
        if not ids:
            raise errors.bad_request("the rendered conversation has no tokens", "messages")
        return [ids]
    inputs = body.inputs()
    if state.tokenizer is None or not any(isinstance(item, str) for item in inputs):
        return inputs
    add_special = body.add_special_tokens is not False

    def tokenize() -> list[str | list[int]]:
        return [
            state.renderer.tokenize(item, add_special_tokens=add_special)
            if isinstance(item, str)
            else item
            for item in inputs
        ]

    return await asyncio.to_thread(tokenize)


async def _embed_one(
    state: ServerState,
    prompt: str | list[int],
    params: PoolingParams,
    request_id: str,
    priority: int,
    lora_request: LoRARequest | None,
) -> EmbeddingRequestOutput:
    state.inflight.add(request_id)  # aborted (with the others) when the server shuts down
    # (the keyword only with an adapter: an engine without LoRA keeps serving the base model)
    extras = {} if lora_request is None else {"lora_request": lora_request}
    start = time.monotonic()
    try:
        stream = state.engine.encode(prompt, params, request_id, priority=priority, **extras)
        async with contextlib.aclosing(stream):
            async for output in stream:
                state.metrics.observe_pooled(output, time.monotonic() - start)
                return output
    except asyncio.CancelledError:
        # aborted (the client left, a sibling input failed, or the server shuts down): counted
        # as generation requests are (refusals and engine failures are not counted)
        state.metrics.success("abort")
        # The server aborted the request itself (shutdown), rather than cancelling us.
        task = asyncio.current_task()
        if state.shutting_down and (task is None or not task.cancelling()):
            raise errors.shutting_down() from None
        raise
    finally:
        state.inflight.discard(request_id)
    raise RuntimeError(f"pooling request {request_id!r} ended without an output")


async def embed_all(
    state: ServerState,
    prompts: list[str | list[int]],
    params: PoolingParams,
    request_id: str,
    priority: int,
    lora_request: LoRARequest | None = None,
) -> list[EmbeddingRequestOutput]:
    """Every prompt's output (pooled with the LoRA adapter ``lora_request``; ``None``: the
    base model), in order; when one fails the others are aborted."""
    if len(prompts) == 1:
        return [await _embed_one(state, prompts[0], params, request_id, priority, lora_request)]
    tasks = [
        asyncio.ensure_future(
            _embed_one(state, p, params, f"{request_id}-{i}", priority, lora_request)
        )
        for i, p in enumerate(prompts)
    ]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:  # (a failure or a cancellation: stop the rest)
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def encoded(body: EmbeddingRequest, vector: list[float]) -> list[float] | str:
    """One vector as ``body`` asks: the floats, or (``base64``) the base64 of its
    ``embed_dtype`` bytes in ``endianness`` order; a 400 when it cannot be encoded."""
    if body.encoding_format != "base64":
        return vector
    try:
        data = encode_vector(vector, body.embed_dtype, body.endianness)
    except ValueError as exc:
        raise errors.bad_request(str(exc), "embed_dtype") from None
    return base64.b64encode(data).decode("ascii")


def binary(
    body: EmbeddingRequest,
    vectors: list[list[float]],
    outputs: list[EmbeddingRequestOutput],
    request_id: str,
    model: str,
) -> Response:
    """The ``bytes`` or ``bytes_only`` answer of ``vectors`` (the pooled ``outputs``, as the
    route sends them); a 400 when one cannot be encoded in ``embed_dtype``."""
    num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    try:
        content, metadata = bytes_body(
            vectors,
            body.embed_dtype,
            body.endianness,
            request_id=request_id,
            created=int(time.time()),
            model=model,
            num_prompt_tokens=num_tokens,
        )
    except ValueError as exc:
        raise errors.bad_request(str(exc), "embed_dtype") from None
    # bytes_only: the same body without the metadata header
    headers = {} if body.encoding_format == "bytes_only" else {"metadata": metadata}
    return Response(content, media_type="application/octet-stream", headers=headers)


def _response(
    body: EmbeddingRequest, outputs: list[EmbeddingRequestOutput], request_id: str, model: str
) -> EmbeddingResponse | Response:
    num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    if body.encoding_format in BINARY_FORMATS:
        return binary(body, [out.outputs.embedding for out in outputs], outputs, request_id, model)
    data = [
        EmbeddingData(index=i, embedding=encoded(body, out.outputs.embedding))
        for i, out in enumerate(outputs)
    ]
    return EmbeddingResponse(
        id=request_id,
        model=model,
        data=data,
        usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
    )


@router.post("/v1/embeddings", response_model=EmbeddingResponse)
async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
    """OpenAI's embeddings API (see the module docstring)."""
    state = _state(request)
    state.check_accepting()
    model, lora_request = state.resolve_model(body.model)
    if getattr(state.engine, "pooler_config", None) is None:
        raise errors.bad_request(
            f"The model '{state.model_name}' is served for text generation and does not "
            "support embeddings; serve it with --runner pooling for /v1/embeddings",
            "model",
        )
    if getattr(state.engine.embedding_info, "classifier", None) is not None:
        raise errors.bad_request(
            f"The model '{state.model_name}' is a sequence-classification model and does not "
            "support embeddings; use /classify (or /score and /rerank for a one-label "
            "cross-encoder, /pooling for its raw outputs)",
            "model",
        )
    body.check_input()
    params = body.pooling_params(state.max_model_len)
    try:
        state.engine.embedding_info.check_dimensions(params.dimensions)
    except ValueError as exc:
        raise errors.bad_request(str(exc), "dimensions") from None
    request_id = f"embd-{uuid.uuid4().hex}"

    async def inputs() -> list[str | list[int]]:
        return await tokenized_inputs(state, body)

    async def collect(prompts: list[str | list[int]]) -> EmbeddingResponse | Response:
        outputs = await embed_all(
            state, prompts, params, request_id, body.priority or 0, lora_request
        )
        return _response(body, outputs, request_id, model)

    return await generation_response(request, False, inputs, never_streamed, collect)
