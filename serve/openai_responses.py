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
``GET /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``
(:mod:`chassis.serve.responses_items`) and ``previous_response_id``; an unknown id is a 404.

The conversation's ``input_image`` parts (its earlier turns' too) are admitted by the engine
and loaded before the prompt renders (:mod:`chassis.serve.responses_images`), and go to the
engine as the request's ``multi_modal_data``, as the chat route's images do; so do its
``input_audio`` parts' clips (admitted and decoded, once, by
:mod:`chassis.serve.responses_audio`). The usage's ``input_tokens`` is the engine's prompt length, each image's
(clip's) placeholder expanded.

With ``background: true`` the response is made by a task of the server
(:mod:`chassis.serve.responses_background`): the request answers at once (``queued``), ``GET``
shows its progress, ``POST /v1/responses/{id}/cancel`` aborts it, and one created with
``stream: true`` can be followed again from any sequence number
(``GET /v1/responses/{id}?stream=true&starting_after=N``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from chassis.serve import errors, structured_request
from chassis.serve.chat_parsing import ChoiceDelta, ChoiceParser, RequestParsing
from chassis.serve.openai_chat import prepare_chat
from chassis.serve.protocol import ChatMessage, check_max_logprobs
from chassis.serve.request_log import log_request
from chassis.serve.responses_audio import audio_params, load_audio, with_audio
from chassis.serve.responses_background import (
    BackgroundResponses,
    BackgroundRun,
    background_responses,
)
from chassis.serve.responses_events import EventLog, EventsBeyondEnd, EventsDropped
from chassis.serve.responses_images import image_refs, load_images, with_images
from chassis.serve.responses_include import check_include, wants_logprobs, without_logprobs
from chassis.serve.responses_input import chat_messages, input_items
from chassis.serve.responses_items import DEFAULT_LIMIT, page, with_ids
from chassis.serve.responses_logprobs import LogprobRouter
from chassis.serve.responses_output import (
    new_id,
    output_items,
    reasoning_text,
    response_status,
    response_usage,
)
from chassis.serve.responses_protocol import (
    OutputItem,
    OutputMessage,
    ResponseObject,
    ResponsesRequest,
)
from chassis.serve.responses_store import (
    EVENT_COPIES_OF_LOGPROBS,
    ResponseStore,
    StoredResponse,
    count_logprobs,
    response_store,
)
from chassis.serve.responses_stream import ResponseEvents
from chassis.serve.state import ServerState, UsageCounter
from chassis.serve.streaming import ClosingStreamingResponse, generation_response

if TYPE_CHECKING:
    from chassis.core.outputs import CompletionOutput, RequestOutput
    from chassis.core.sampling_params import SamplingParams
    from chassis.serve.protocol import ChatLogprobToken

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
    #: the stream events, kept for a background response created with ``stream: true``
    #: (the newest ``store.max_events_per_response`` of them)
    events: EventLog | None = None
    #: when the request arrived (the same in every event of a stream)
    created_at: int = field(default_factory=lambda: int(time.time()))
    #: the final response, once made
    final: ResponseObject | None = None

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
            background=bool(body.background),
        )

    def logprobs(self) -> LogprobRouter | None:
        """The router of the message's logprobs, when the request asked for them."""
        asked = self.body.logprobs_asked
        if asked is None:
            return None
        as_ids = self.state.tokens_as_ids(self.body.return_tokens_as_token_ids)
        return LogprobRouter(self.state, asked, as_ids)

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
        self.keep(response)
        return response

    def keep(self, response: ResponseObject) -> None:
        """Make ``response`` the final one, stored when ``store``."""
        self.final = response
        if self.body.store is not False:
            as_json = response.model_dump(mode="json")
            # the conversation shares the response's output items (their logprobs may be
            # large; nothing changes a stored item: readers copy what they alter)
            output = as_json["output"]
            num_logprobs = count_logprobs(output)
            if self.events is not None:
                # the event log holds each entry again in its delta and in the four final
                # events (output_text.done, content_part.done, output_item.done, completed)
                num_logprobs *= 1 + EVENT_COPIES_OF_LOGPROBS
            stored = StoredResponse(
                as_json,
                self.conversation + output,
                num_input_items=len(self.conversation),
                events=self.events,
                num_logprobs=num_logprobs,
            )
            self.store.put(self.response_id, stored)


def _parsed(parser: ChoiceParser | None, text: str) -> ChoiceDelta:
    return parser.parse(text) if parser is not None else ChoiceDelta(content=text)


class _Parse:
    """A streamed choice's parsing: its :class:`ChoiceParser` (``None``: all text is
    content), whether what the parser holds back (a possible tag's prefix) was flushed,
    which may happen once: when the choice finished, when the engine stream ended without a
    finish reason, or when a background response is cancelled; and, when the request asked
    for them, the router of its tokens' logprobs to the message text."""

    def __init__(self, parsing: RequestParsing | None, logprobs: LogprobRouter | None) -> None:
        self._parser = parsing.choice_parser() if parsing is not None else None
        self._flushed = False
        self._logprobs = logprobs

    def events(self, writer: ResponseEvents, completion: CompletionOutput) -> list[str]:
        """The events of one engine output (flushing the parser when it finished)."""
        late, delta = self._advance(completion)
        events = writer.add_logprobs(late) if late else []
        return events + writer.feed(delta, self.route(delta))

    def flush_events(self, writer: ResponseEvents) -> list[str]:
        """The events of what the parser still holds back."""
        delta = self.flush()
        return writer.feed(delta, self.route(delta))

    def message_logprobs(self, completion: CompletionOutput) -> list[ChatLogprobToken]:
        """The logprobs of the message text among one engine output's tokens (and of the
        text it released), without events: for a non-streamed response."""
        if self._logprobs is None:
            return []
        late, delta = self._advance(completion)
        return late + self.route(delta)

    def _advance(self, completion: CompletionOutput) -> tuple[list[ChatLogprobToken], ChoiceDelta]:
        """Take one engine output: the logprobs of textless tokens after the message text
        already out (:meth:`LogprobRouter.add`), and its text's classified part (with what
        the parser held back when it finished)."""
        late = self._logprobs.add(completion) if self._logprobs is not None else []
        delta = self.feed(completion.text)
        if completion.finished:
            delta += self.flush()
        return late, delta

    def flush_logprobs(self) -> list[ChatLogprobToken]:
        """The logprobs of the message text the parser still holds back, without events
        (nothing is flushed when no logprobs were asked for)."""
        if self._logprobs is None:
            return []
        return self.route(self.flush())

    def route(self, delta: ChoiceDelta) -> list[ChatLogprobToken]:
        """The logprobs of ``delta``'s content (``[]`` when none were asked for)."""
        return self._logprobs.route(delta) if self._logprobs is not None else []

    def feed(self, text: str) -> ChoiceDelta:
        """The classified part of ``text``, the next piece of the message."""
        return ChoiceDelta(content=text) if self._parser is None else self._parser.feed(text)

    def flush(self) -> ChoiceDelta:
        """What the parser still holds back (empty after the first call)."""
        if self._parser is None or self._flushed:
            return ChoiceDelta()
        self._flushed = True
        return self._parser.finish()


async def _collect(
    turn: _Turn, stream: AsyncIterator[RequestOutput], parsing: RequestParsing | None
) -> ResponseObject:
    texts: list[str] = []
    finish: str | None = None
    usage = UsageCounter()
    # the text is parsed whole; the logprobs are routed as a stream's would be
    logprobs = _Parse(parsing, turn.logprobs())
    message_logprobs: list[ChatLogprobToken] = []
    async with contextlib.aclosing(stream):
        async for output in stream:
            usage.add(0, output)
            for completion in output.outputs:
                texts.append(completion.text)
                finish = completion.finish_reason or finish
                message_logprobs += logprobs.message_logprobs(completion)
    message_logprobs += logprobs.flush_logprobs()
    parser = parsing.choice_parser() if parsing is not None else None
    status, _ = response_status(finish)
    items = output_items(_parsed(parser, "".join(texts)), status)
    for item in items:
        if isinstance(item, OutputMessage) and item.content:
            item.content[0].logprobs = message_logprobs
    return turn.finish(finish, items, usage)


async def _events(
    turn: _Turn, stream: AsyncIterator[RequestOutput], parsing: RequestParsing | None
) -> AsyncIterator[str]:
    writer = ResponseEvents(turn.in_progress())
    for event in writer.start():
        yield event
    parse = _Parse(parsing, turn.logprobs())
    output = _output_events(turn, writer, stream, parse, UsageCounter())
    async with contextlib.aclosing(output) as events:
        async for event in events:
            yield event


async def _output_events(
    turn: _Turn,
    writer: ResponseEvents,
    stream: AsyncIterator[RequestOutput],
    parse: _Parse,
    usage: UsageCounter,
) -> AsyncIterator[str]:
    """The events after ``response.in_progress``: the output items, then the final response
    (made by ``turn.finish``); a failure ends them with ``error`` and ``response.failed``."""
    finish: str | None = None
    try:
        async with contextlib.aclosing(stream):
            async for output in stream:
                usage.add(0, output)
                for completion in output.outputs:
                    finish = completion.finish_reason or finish
                    for event in parse.events(writer, completion):
                        yield event
        # aborted (no finish reason): what the parsers held
        for event in parse.flush_events(writer):
            yield event
        status, _ = response_status(finish)
        for event in writer.finish(status):
            yield event
        yield writer.end(turn.finish(finish, writer.items, usage))
    except Exception as exc:
        # Headers are sent: the failure becomes events (e.g. the engine died).
        for event in _failed(writer, exc):
            yield event


def _failed(writer: ResponseEvents, exc: Exception) -> list[str]:
    """The ``error`` and ``response.failed`` events of ``exc``; the response's error code is
    ``invalid_prompt`` when the request was at fault (a 400), else ``server_error``."""
    error = errors.to_api_error(exc)
    kind = "invalid_prompt" if error.status == 400 else "server_error"
    return writer.failed(error.message, error.code or error.status, error.param, kind)


async def _run_background(
    turn: _Turn,
    run: BackgroundRun,
    writer: ResponseEvents,
    open_stream: Callable[[], Awaitable[AsyncIterator[RequestOutput]]],
    parsing: RequestParsing | None,
) -> None:
    """Make a background response: its events go to ``run``, its final response (also a
    failed or cancelled one) to the store."""
    usage = UsageCounter()
    parse = _Parse(parsing, turn.logprobs())
    try:
        if run.cancel_requested:  # cancelled before this task first ran
            raise asyncio.CancelledError
        stream = await open_stream()
        run.status = "in_progress"
        run.add_event(writer.in_progress())
        output = _output_events(turn, writer, stream, parse, usage)
        async with contextlib.aclosing(output) as events:
            async for event in events:
                run.add_event(event)
        if writer.failed_response is not None:
            turn.keep(writer.failed_response)
    except asyncio.CancelledError:
        # POST .../cancel or shutdown: closing the engine stream aborted the engine request;
        # the response keeps what was made, its last item incomplete, including the text
        # the parsers held back (a possible tag's prefix: generated text, classified as a
        # whole-message parse of the same text would classify it)
        if turn.final is not None:
            return
        for event in parse.flush_events(writer):
            run.add_event(event)
        if writer.has_output:
            for event in writer.finish("cancelled"):
                run.add_event(event)
        run.add_event(writer.end(turn.finish(None, writer.items, usage)))
    except Exception as exc:  # the engine refused the request (a 400), or is dead
        for event in _failed(writer, exc):
            run.add_event(event)
        assert writer.failed_response is not None
        turn.keep(writer.failed_response)


def _start_background(
    request: Request,
    turn: _Turn,
    open_stream: Callable[[], Awaitable[AsyncIterator[RequestOutput]]],
    parsing: RequestParsing | None,
) -> Response:
    """Start a background response; answer with it (``queued``), or follow its events when
    the request streams."""
    writer = ResponseEvents(turn.in_progress())

    def snapshot() -> ResponseObject:
        if turn.final is not None:  # ended (stored, though the store may drop it at once)
            return turn.final
        output = [item.model_copy(deep=True) for item in writer.items]
        return turn.in_progress().model_copy(update={"status": run.status, "output": output})

    run = BackgroundRun(turn.response_id, snapshot, turn.events, turn.conversation)
    run.add_event(writer.created("queued"))
    run.add_event(writer.queued())
    background_responses(request.app).start(
        run, lambda run: _run_background(turn, run, writer, open_stream, parsing)
    )
    if turn.events is not None:
        return _sse(run.follow())
    return JSONResponse(snapshot().model_dump(mode="json"))


def _sse(events: AsyncIterator[str]) -> Response:
    return ClosingStreamingResponse(
        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def _check_unique_ids(history: list[dict[str, Any]], new: list[dict[str, Any]]) -> None:
    """A 400 (as OpenAI) for an input item whose id is already an item of the conversation:
    the ``input_items`` listing pages by item id."""
    seen = {item.get("id") for item in history}
    for item in new:
        if item["id"] in seen:
            raise errors.bad_request(
                f"duplicate item id {item['id']!r}: an item of the conversation (an earlier "
                "input, or the previous response's output) already has it; send only the new "
                "items with previous_response_id, and one id per item",
                "input",
            )
        seen.add(item["id"])


def _conversation(
    store: ResponseStore, runs: BackgroundResponses, body: ResponsesRequest
) -> tuple[list[dict[str, Any]], list[ChatMessage], int]:
    """The conversation's items before the output (previous turns, then ``input``, each
    with an ``id``), the chat messages to render (``instructions`` first), and how many of
    the items are the previous turns'."""
    new = with_ids(input_items(body.input))
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        if runs.get(body.previous_response_id) is not None:
            raise errors.bad_request(
                f"response '{body.previous_response_id}' is still in progress: continue it "
                "once it has finished",
                "previous_response_id",
            )
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        history = previous.conversation
    _check_unique_ids(history, new)
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
    return history + new, messages, len(history)


def _check_max_logprobs(state: ServerState, body: ResponsesRequest) -> None:
    """A 400 naming ``top_logprobs`` for more alternatives than the engine computes
    (``--max-logprobs``), before anything runs: a background response would otherwise fail
    in the engine."""
    check_max_logprobs(state.engine.config.max_logprobs, top_logprobs=body.logprobs_asked)


def _as_included(response: dict[str, Any], include: list[str]) -> dict[str, Any]:
    """A response (as JSON) with its ``output_text`` logprobs only when ``include`` asks
    for them."""
    if wants_logprobs(include):
        return response
    return {**response, "output": without_logprobs(response.get("output") or [])}


@router.post("/v1/responses", response_model=ResponseObject)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    """OpenAI's Responses API (one output; see the module docstring)."""
    state = _state(request)
    state.check_accepting()
    model, lora_request = state.resolve_model(body.model)
    body.check()
    _check_max_logprobs(state, body)
    store = response_store(request.app)
    conversation, messages, num_earlier = _conversation(
        store, background_responses(request.app), body
    )
    images = await load_images(state.renderer.chat_images, image_refs(conversation, num_earlier))
    if images:
        messages = with_images(messages, images)
    clips = await load_audio(state.renderer.chat_images, audio_params(conversation, num_earlier))
    if clips:
        messages = with_audio(messages, clips)
    chat_body = body.chat_request(messages)
    taken: list[Any] = []  # (the loaded images again, as the renderer took them)
    taken_clips: list[Any] = []  # (the decoded clips again, as the renderer took them)
    params, prompt_ids, parsing = await prepare_chat(state, chat_body, taken, audios=taken_clips)
    # (mm_processor_kwargs without images or audio are ignored, as on the chat route)
    multimodal: dict[str, Any] = {}
    data = {key: items for key, items in (("image", taken), ("audio", taken_clips)) if items}
    if data:
        multimodal = {"multi_modal_data": data, "mm_processor_kwargs": body.mm_processor_kwargs}
    response_id = new_id("resp")
    log_request(
        state.settings, response_id, None, prompt_ids, params, lora_request, state.tokenizer
    )
    events = store.new_event_log() if body.background and body.stream else None
    turn = _Turn(state, store, body, response_id, model, params, conversation, events)

    def open_stream() -> Awaitable[AsyncIterator[RequestOutput]]:
        return state.open_stream(
            prompt_ids,
            params,
            response_id,
            body.priority or 0,
            lora_request,
            body.cache_salt,
            **multimodal,
        )

    def check_request() -> Awaitable[None]:
        return state.check_request(
            prompt_ids, params, body.priority or 0, lora_request, body.cache_salt, **multimodal
        )

    if chat_body.forces_tool_calls:  # (a refused constraint came from tools: say so)
        open_stream = structured_request.naming_tools(open_stream)
        check_request = structured_request.naming_tools(check_request)

    if body.background:
        # the engine checks the request only when it starts, after the answer here: what
        # it would refuse (prompt over the context, sampling values, constraint, ...) is
        # the same 400 now as without background, not a response that fails later
        await check_request()
        return _start_background(request, turn, open_stream, parsing)
    return await generation_response(
        request,
        bool(body.stream),
        open_stream,
        lambda stream: _events(turn, stream, parsing),
        lambda stream: _collect(turn, stream, parsing),
    )


@router.get("/v1/responses/{response_id}", response_model=ResponseObject)
async def retrieve_response(
    response_id: str,
    request: Request,
    stream: bool = False,
    starting_after: int | None = None,
    include_obfuscation: bool | None = None,
    include: list[str] | None = Query(None),
    # the openai SDK sends lists as include[]=a&include[]=b
    include_brackets: list[str] | None = Query(None, alias="include[]"),
) -> Response:
    """A response: a stored one as it was returned, a running background one as it stands;
    a 404 for an unknown (or dropped) id. With ``?stream=true``, the events of a background
    response created with ``stream: true`` after sequence number ``starting_after`` (all
    when absent), then the rest as they come; a 400 for any other response, and one naming
    ``starting_after`` when some of those events are no longer kept (a response's log keeps
    its newest events only, :mod:`chassis.serve.responses_events`) or, once the response
    has finished, when it is above the last event (the stream would be empty forever).
    ``include_obfuscation`` is accepted and has no effect (no obfuscation is added);
    ``include`` (as ``include=`` or ``include[]=``) follows
    :func:`~chassis.serve.responses_include.check_include`: values that add nothing here
    are accepted, the others a 400."""
    included = [*(include or []), *(include_brackets or [])]
    check_include(included)
    run = background_responses(request.app).get(response_id)
    stored = response_store(request.app).get(response_id) if run is None else None
    if run is None and stored is None:
        raise _not_found(response_id, "response_id")
    if not stream:
        if starting_after is not None:
            raise errors.bad_request("starting_after needs stream=true", "starting_after")
        if run is not None:
            return JSONResponse(_as_included(run.snapshot().model_dump(mode="json"), included))
        assert stored is not None
        return JSONResponse(_as_included(stored.response, included))
    after = -1 if starting_after is None else starting_after
    if after < -1:
        raise errors.bad_request(
            f"starting_after must be a sequence number (0 or more), or -1 for every event; got {after}",
            "starting_after",
        )
    try:
        if run is not None and run.events is not None:
            return _sse(run.follow(after))
        if stored is not None and stored.events is not None:
            return _sse(_replay(stored.events.after(after)))
    except (EventsDropped, EventsBeyondEnd) as exc:
        raise errors.bad_request(str(exc), "starting_after") from None
    if stored is not None and stored.events_dropped:
        raise errors.bad_request(
            "the stream events of this response are no longer kept (the server keeps a "
            "bounded number, the least recently used responses' going first): retrieve it "
            "without stream",
            "stream",
        )
    raise errors.bad_request(
        "only a background response created with stream: true can be streamed again: "
        "retrieve this one without stream",
        "stream",
    )


async def _replay(events: list[str]) -> AsyncIterator[str]:
    for event in events:
        yield event


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    request: Request,
    after: str | None = None,
    before: str | None = None,
    limit: int = DEFAULT_LIMIT,
    order: str = "desc",
    include: list[str] | None = Query(None),
    # the openai SDK sends lists as include[]=a&include[]=b
    include_brackets: list[str] | None = Query(None, alias="include[]"),
) -> JSONResponse:
    """The input items of a response (stored or running) as OpenAI's list object, a page
    at a time (:func:`~chassis.serve.responses_items.page`); a 404 for an unknown id, 400s
    for bad parameters. ``include`` may come as ``include=`` or ``include[]=``."""
    included = [*(include or []), *(include_brackets or [])]
    check_include(included)
    run = background_responses(request.app).get(response_id)
    if run is not None:
        items = run.input_items
    else:
        stored = response_store(request.app).get(response_id)
        if stored is None:
            raise _not_found(response_id, "response_id")
        items = stored.input_items
    if not wants_logprobs(included):
        items = without_logprobs(items)
    listing = page(items, after=after, before=before, limit=limit, order=order)  # type: ignore[arg-type]
    return JSONResponse(listing)


@router.post("/v1/responses/{response_id}/cancel", response_model=ResponseObject)
async def cancel_response(response_id: str, request: Request) -> JSONResponse:
    """Cancel a background response: its engine request is aborted (its KV blocks freed)
    and it ends ``cancelled`` with the output made so far. Cancelling a cancelled response
    returns it again; a response that was not made in the background, or has finished
    otherwise, is a 400; an unknown id a 404."""
    store = response_store(request.app)
    runs = background_responses(request.app)
    run = runs.get(response_id)
    if run is not None:
        await runs.cancel(response_id)
        stored = store.get(response_id)
        if stored is not None:
            return JSONResponse(stored.response)
        return JSONResponse(run.snapshot().model_dump(mode="json"))  # the store dropped it
    stored = store.get(response_id)
    if stored is None:
        raise _not_found(response_id, "response_id")
    status = stored.response.get("status")
    if not stored.response.get("background"):
        raise errors.bad_request(
            "only a background response can be cancelled: this one was not created with "
            "background: true",
            "response_id",
        )
    if status != "cancelled":
        raise errors.bad_request(
            f"the response has already finished (status {status!r}): only a queued or "
            "in-progress background response can be cancelled",
            "response_id",
        )
    return JSONResponse(stored.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    """Forget a stored response (OpenAI's deletion object), cancelling it first when it is a
    running background response; a 404 for an unknown id."""
    was_running = await background_responses(request.app).cancel(response_id)
    # (a cancelled response the store dropped at once was still there to delete)
    if not response_store(request.app).delete(response_id) and not was_running:
        raise _not_found(response_id, "response_id")
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
