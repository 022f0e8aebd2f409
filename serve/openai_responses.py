"""``POST /v1/responses`` (OpenAI's Responses API), ``GET`` and ``DELETE
/v1/responses/{response_id}``.

A Responses request runs as a chat completion: its conversation (the stored conversation of
``previous_response_id``, then ``input``; ``instructions`` as a first system message) becomes
chat messages (:mod:`chassis.serve.responses_input`), the request a
:class:`~chassis.serve.protocol.ChatCompletionRequest`
(:meth:`~chassis.serve.responses_protocol.ResponsesRequest.chat_request`), and the chat
route's :func:`~chassis.serve.openai_chat.prepare_chat` renders it and builds its sampling
params and parsers. The generated message becomes output items
(:mod:`chassis.serve.responses_output`), streamed as OpenAI's semantic events
(:mod:`chassis.serve.responses_stream`) with ``stream: true``.

With ``store`` (the default) the finished response and its conversation are kept in the
server's bounded in-memory store (:mod:`chassis.serve.responses_store`) for
``GET /v1/responses/{id}`` and ``previous_response_id``; an unknown id is a 404.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from chassis.serve import errors
from chassis.serve.chat_parsing import ChoiceDelta, ChoiceParser, RequestParsing
from chassis.serve.openai_chat import prepare_chat
from chassis.serve.protocol import ChatMessage
from chassis.serve.request_log import log_request
from chassis.serve.responses_input import chat_messages, input_items
from chassis.serve.responses_output import (
    new_id,
    output_items,
    reasoning_text,
    response_status,
    response_usage,
)
from chassis.serve.responses_protocol import OutputItem, ResponseObject, ResponsesRequest
from chassis.serve.responses_store import ResponseStore, StoredResponse, response_store
from chassis.serve.responses_stream import ResponseEvents
from chassis.serve.state import ServerState, UsageCounter
from chassis.serve.streaming import generation_response

if TYPE_CHECKING:
    from chassis.core.outputs import RequestOutput
    from chassis.core.sampling_params import SamplingParams

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.chassis


def _not_found(response_id: str, param: str) -> errors.APIError:
    return errors.APIError(
        404,
        f"No response with id '{response_id}' is stored on this server (responses are kept "
        "in memory, the least recently used dropped first, and only with store: true)",
        param=param,
        code="response_not_found",
    )


@dataclass
class _Turn:
    """One response being made: its echo fields, conversation and where it is stored."""

    state: ServerState
    store: ResponseStore
    body: ResponsesRequest
    response_id: str
    model: str
    params: SamplingParams
    #: the items before this response's output (previous turns, then ``input``)
    conversation: list[dict[str, Any]]
    #: when the request arrived (the same in every event of a stream)
    created_at: int = field(default_factory=lambda: int(time.time()))

    def in_progress(self) -> ResponseObject:
        """The response with its echo fields and no output yet."""
        body = self.body
        return ResponseObject(
            id=self.response_id,
            created_at=self.created_at,
            status="in_progress",
            model=self.model,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            metadata=body.metadata,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            previous_response_id=body.previous_response_id,
            reasoning=body.reasoning,
            store=body.store is not False,
            temperature=self.params.temperature,
            top_p=self.params.top_p,
            text=body.text if (body.text or {}).get("format") else {"format": {"type": "text"}},
            tool_choice=body.tool_choice if body.tool_choice is not None else "auto",
            tools=list(body.tools or []),
            user=body.user,
        )

    def finish(
        self, finish_reason: str | None, items: list[OutputItem], usage: UsageCounter
    ) -> ResponseObject:
        """The finished response (stored when ``store``)."""
        status, details = response_status(finish_reason)
        response = self.in_progress().model_copy(
            update={
                "status": status,
                "incomplete_details": details,
                "output": items,
                "usage": response_usage(usage, self.state.tokenizer, reasoning_text(items)),
            }
        )
        if self.body.store is not False:
            output = [item.model_dump(mode="json") for item in items]
            stored = StoredResponse(response.model_dump(mode="json"), self.conversation + output)
            self.store.put(self.response_id, stored)
        return response


def _parsed(parser: ChoiceParser | None, text: str) -> ChoiceDelta:
    return parser.parse(text) if parser is not None else ChoiceDelta(content=text)


async def _collect(
    turn: _Turn, stream: AsyncIterator[RequestOutput], parsing: RequestParsing | None
) -> ResponseObject:
    texts: list[str] = []
    finish: str | None = None
    usage = UsageCounter()
    async with contextlib.aclosing(stream):
        async for output in stream:
            usage.add(0, output)
            for completion in output.outputs:
                texts.append(completion.text)
                finish = completion.finish_reason or finish
    parser = parsing.choice_parser() if parsing is not None else None
    status, _ = response_status(finish)
    items = output_items(_parsed(parser, "".join(texts)), status)
    return turn.finish(finish, items, usage)


async def _events(
    turn: _Turn, stream: AsyncIterator[RequestOutput], parsing: RequestParsing | None
) -> AsyncIterator[str]:
    writer = ResponseEvents(turn.in_progress())
    parser = parsing.choice_parser() if parsing is not None else None
    usage = UsageCounter()
    finish: str | None = None
    for event in writer.start():
        yield event
    try:
        async with contextlib.aclosing(stream):
            async for output in stream:
                usage.add(0, output)
                for completion in output.outputs:
                    if parser is None:
                        delta = ChoiceDelta(content=completion.text)
                    else:
                        delta = parser.feed(completion.text)
                        if completion.finished:
                            delta += parser.finish()
                    finish = completion.finish_reason or finish
                    for event in writer.feed(delta):
                        yield event
        if finish is None and parser is not None:  # aborted: what the parsers held
            for event in writer.feed(parser.finish()):
                yield event
        status, _ = response_status(finish)
        for event in writer.finish(status):
            yield event
        yield writer.end(turn.finish(finish, writer.items, usage))
    except Exception as exc:
        # Headers are sent: the failure becomes events (e.g. the engine died).
        error = errors.to_api_error(exc)
        for event in writer.failed(error.message, error.code or error.status, error.param):
            yield event


def _conversation(
    store: ResponseStore, body: ResponsesRequest
) -> tuple[list[dict[str, Any]], list[ChatMessage]]:
    """The conversation's items before the output (previous turns, then ``input``), and
    the chat messages to render (``instructions`` first)."""
    new = input_items(body.input)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        history = previous.conversation
    earlier_calls = [
        item["call_id"]
        for item in history
        if item.get("type") == "function_call" and isinstance(item.get("call_id"), str)
    ]
    messages = chat_messages(new, earlier_calls=earlier_calls)  # alone: 400s name input.i
    if history:
        # one pass over both: calls in input join the assistant turn that ends the history
        messages = chat_messages(history + new)
    if body.instructions:
        messages.insert(0, ChatMessage(role="system", content=body.instructions))
    if not messages:
        raise errors.bad_request("input must not be empty", "input")
    return history + new, messages


@router.post("/v1/responses", response_model=ResponseObject)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    """OpenAI's Responses API (one output; see the module docstring)."""
    state = _state(request)
    state.check_accepting()
    model, lora_request = state.resolve_model(body.model)
    body.check()
    store = response_store(request.app)
    conversation, messages = _conversation(store, body)
    params, prompt_ids, parsing = await prepare_chat(state, body.chat_request(messages))
    response_id = new_id("resp")
    log_request(
        state.settings, response_id, None, prompt_ids, params, lora_request, state.tokenizer
    )
    turn = _Turn(state, store, body, response_id, model, params, conversation)
    return await generation_response(
        request,
        bool(body.stream),
        lambda: state.open_stream(
            prompt_ids, params, response_id, body.priority or 0, lora_request, body.cache_salt
        ),
        lambda stream: _events(turn, stream, parsing),
        lambda stream: _collect(turn, stream, parsing),
    )


@router.get("/v1/responses/{response_id}", response_model=ResponseObject)
async def retrieve_response(
    response_id: str, request: Request, stream: bool = False
) -> JSONResponse:
    """A stored response, as it was returned; a 404 for an unknown (or dropped) id, a 400
    for ``?stream=true`` (replaying a finished response's events is not supported)."""
    if stream:
        raise errors.bad_request(
            "a stored response cannot be streamed again: retrieve it without stream", "stream"
        )
    stored = response_store(request.app).get(response_id)
    if stored is None:
        raise _not_found(response_id, "response_id")
    return JSONResponse(stored.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    """Forget a stored response (OpenAI's deletion object); a 404 for an unknown id."""
    if not response_store(request.app).delete(response_id):
        raise _not_found(response_id, "response_id")
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
