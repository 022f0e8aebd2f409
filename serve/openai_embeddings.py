"""``POST /v1/embeddings``: OpenAI's embeddings API, served by a pooling engine.

Needs ``chassis serve MODEL --runner pooling``; a generating server answers 400 (and a
pooling server refuses completions and chat with 400). ``input`` is a string, a list of
strings, a list of token ids or a list of lists of token ids; each is one engine request, all
run concurrently (batched by the scheduler). Text is tokenized in a worker thread, with the
tokenizer's special tokens unless ``add_special_tokens`` is false. ``encoding_format``
``"base64"`` gives each vector as the base64 of its little-endian float32 bytes (what the
``openai`` client asks for by default and decodes). ``dimensions`` truncates the vector
(then normalizes it) only for models trained for it (Matryoshka: ``matryoshka_dimensions`` or
``is_matryoshka`` in ``config.json``); otherwise it is refused. Besides OpenAI's fields the
request takes vLLM's ``truncate_prompt_tokens``, ``add_special_tokens``, ``normalize`` (or
its newer name ``use_activation``) and ``priority``.

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
from typing import TYPE_CHECKING, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from chassis.core.input_processor import truncation_length
from chassis.core.pooling_outputs import encode_pooled
from chassis.core.pooling_params import PoolingParams
from chassis.serve import errors
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
    """OpenAI's embeddings request, plus vLLM's extra fields; unknown fields are logged and
    ignored (as on the other routes)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = None
    user: str | None = None
    # -- vLLM extra fields ------------------------------------------------------------------
    #: keep each input's last k tokens (-1: the last max_model_len; above it: a 400)
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = True
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

    def inputs(self) -> list[str | list[int]]:
        """The batch of inputs; a 400 for an empty batch, an empty input or too many."""
        value = self.input
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
    #: the vector, or (``encoding_format: "base64"``) the base64 of its float32 bytes
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
    (``--skip-tokenizer-init``) text goes on as is and the engine refuses it with a 400."""
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
    try:
        stream = state.engine.encode(prompt, params, request_id, priority=priority, **extras)
        async with contextlib.aclosing(stream):
            async for output in stream:
                return output
    except asyncio.CancelledError:
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


def _response(
    body: EmbeddingRequest, outputs: list[EmbeddingRequestOutput], request_id: str, model: str
) -> EmbeddingResponse:
    as_base64 = body.encoding_format == "base64"
    data = [
        EmbeddingData(
            index=i,
            embedding=base64.b64encode(encode_pooled(out.outputs.embedding)).decode("ascii")
            if as_base64
            else out.outputs.embedding,
        )
        for i, out in enumerate(outputs)
    ]
    num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
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
    params = body.pooling_params(state.max_model_len)
    try:
        state.engine.embedding_info.check_dimensions(params.dimensions)
    except ValueError as exc:
        raise errors.bad_request(str(exc), "dimensions") from None
    request_id = f"embd-{uuid.uuid4().hex}"

    async def inputs() -> list[str | list[int]]:
        return await tokenized_inputs(state, body)

    async def collect(prompts: list[str | list[int]]) -> EmbeddingResponse:
        outputs = await embed_all(
            state, prompts, params, request_id, body.priority or 0, lora_request
        )
        return _response(body, outputs, request_id, model)

    return await generation_response(request, False, inputs, never_streamed, collect)
