"""``POST /v1/chat/completions``: messages in, an assistant message out, streamed or not.

The messages are rendered with the chat template and tokenized (without special tokens by
default: the template writes BOS) in a worker thread, then sent to the engine as token ids.
A stream starts with one chunk per choice carrying the role (``"assistant"``, see
:func:`response_role`) and empty content,
then content deltas, the finish reason on each choice's last chunk, an optional usage chunk
(``stream_options.include_usage``: empty ``choices``), and ``data: [DONE]``.

Image parts (``image_url`` with a data, http(s) or, under ``--allowed-local-media-path``, file
URL), video parts (``video_url``, the same kinds of URL, decoded with PyAV) and audio parts
(``input_audio``, ``audio_url``; :mod:`chassis.core.audio_loading`) are loaded while the
messages render, and go to the engine as the request's ``multi_modal_data`` for a
model that takes them (a 400 otherwise, naming the part); ``mm_processor_kwargs`` (vLLM's
field) goes with them. Beam search takes no images, videos or audio.

``echo`` (vLLM's field): when the last message has the response's role (an assistant message
continued with ``continue_final_message``), each choice's content starts with that message's
content (text parts joined by newlines). As in vLLM, the echo is not parsed: it is put before
the parsed content (after ``--reasoning-parser`` and the tool parser; reasoning and tool calls
are left as they are), and streamed as its own chunk right after the role chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from chassis.core.chat import content_text
from chassis.serve import errors, structured_request
from chassis.serve.beam_search import beam_search_response
from chassis.serve.chat_parsing import (
    ChoiceDelta,
    ChoiceParser,
    RequestParsing,
    finish_reason,
    tool_call_delta_json,
    tool_call_json,
)
from chassis.serve.protocol import (
    MIN_LOGPROB,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobToken,
    ChatLogprobTop,
    ChatResponseMessage,
    check_max_logprobs,
    json_logprob,
)
from chassis.serve.request_log import log_request
from chassis.serve.state import ServerState
from chassis.serve.stream_chunks import ChunkEncoder, chat_choice
from chassis.serve.streaming import (
    SSE_DONE,
    generation_response,
    sse,
)

if TYPE_CHECKING:
    from chassis.core.outputs import CompletionOutput, RequestOutput
    from chassis.core.sampling_params import SamplingParams

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.chassis


def response_role(state: ServerState, body: ChatCompletionRequest) -> str:
    """The role of the response's messages (vLLM's rule): ``--response-role`` (default
    ``assistant``) when the prompt ends with the generation prompt, else (the model continues
    the last message) that message's role."""
    if body.add_generation_prompt is not False:
        return state.settings.response_role
    return body.messages[-1].role


def chat_logprobs(
    state: ServerState, completion: CompletionOutput, top_n: int, as_ids: bool = False
) -> list[ChatLogprobToken]:
    """OpenAI chat logprobs for the tokens of one delta. With ``as_ids``
    (``--return-tokens-as-token-ids``) each ``token`` is ``"token_id:ID"``; ``bytes`` stay
    the token's own text's."""
    out = []
    for token_id, position in zip(completion.token_ids, completion.logprobs or [], strict=False):
        sampled = position.get(token_id)
        decoded = sampled.decoded_token if sampled else None
        text = state.token_text(token_id, decoded)
        ranked = sorted(position.items(), key=lambda kv: kv[1].rank)[:top_n]
        top = []
        for tid, lp in ranked:
            top_text = state.token_text(tid, lp.decoded_token)
            top.append(
                ChatLogprobTop(
                    token=state.token_text(tid, lp.decoded_token, as_id=as_ids),
                    logprob=json_logprob(lp.logprob),
                    bytes=list(top_text.encode("utf-8")),
                )
            )
        out.append(
            ChatLogprobToken(
                token=state.token_text(token_id, decoded, as_id=as_ids),
                # a sampled token outside the returned set has no known logprob
                logprob=json_logprob(sampled.logprob if sampled else MIN_LOGPROB),
                bytes=list(text.encode("utf-8")),
                top_logprobs=top,
            )
        )
    return out


def _echo(body: ChatCompletionRequest, role: str) -> str:
    """What ``echo`` puts before each choice's content: the last message's content when it
    has the response's ``role`` (vLLM's rule), else nothing."""
    last = body.messages[-1]
    if not body.echo or last.role != role:
        return ""
    # (the renderer has read this content already: a content it refuses never gets here)
    return content_text(last.content, len(body.messages) - 1)


async def _prompt(
    state: ServerState,
    body: ChatCompletionRequest,
    images: list[Any] | None = None,
    videos: list[Any] | None = None,
    audios: list[Any] | None = None,
) -> tuple[str, list[int]]:
    """The rendered prompt's text (parsers read it) and token ids; the messages' images
    appended to ``images`` when it is given (else image parts are a 400), their videos to
    ``videos`` (else video parts are a 400), their audio clips to ``audios`` likewise. With
    ``--exclude-tools-when-tool-choice-none`` a request whose ``tool_choice`` is ``"none"``
    renders without its tools (vLLM's flag; by default the template still sees them)."""
    tools = body.tools
    if body.tool_choice == "none" and state.settings.exclude_tools_when_tool_choice_none:
        tools = None
    return await asyncio.to_thread(
        state.renderer.render_prompt,
        body.messages,
        add_generation_prompt=body.add_generation_prompt is not False,
        continue_final_message=bool(body.continue_final_message),
        tools=tools,
        chat_template_kwargs=body.template_kwargs(),
        chat_template=body.chat_template,
        add_special_tokens=bool(body.add_special_tokens),
        images=images,
        videos=videos,
        audios=audios,
    )


def _parsed_message(parsed: ChoiceDelta, parser: ChoiceParser, role: str) -> ChatResponseMessage:
    """The message of a parsed choice. Content that is empty next to reasoning (sent or
    dropped by ``include_reasoning``), or only whitespace next to tool calls, is null, as
    OpenAI sends for a message of tool calls."""
    content: str | None = parsed.content
    if (parsed.calls and not parsed.content.strip()) or (parser.saw_reasoning and not content):
        content = None
    return ChatResponseMessage(
        role=role,
        content=content,
        reasoning=parsed.reasoning or None,
        tool_calls=[tool_call_json(call) for call in parsed.calls],
    )


async def _collect(
    state: ServerState,
    stream: AsyncIterator[RequestOutput],
    body: ChatCompletionRequest,
    request_id: str,
    model: str,
    n: int,
    parsing: RequestParsing | None,
) -> ChatCompletionResponse:
    texts: dict[int, list[str]] = {i: [] for i in range(n)}
    token_ids: dict[int, list[int]] = {i: [] for i in range(n)}
    prompt_token_ids: list[int] | None = None
    logprobs: dict[int, list[ChatLogprobToken]] = {i: [] for i in range(n)}
    finish: dict[int, tuple[str | None, int | str | None]] = {}
    top_n = body.top_logprobs or 0
    as_ids = state.tokens_as_ids(body.return_tokens_as_token_ids)
    usage = state.usage_counter()
    prompt_logprobs = None
    async with contextlib.aclosing(stream):
        async for output in stream:
            usage.add(0, output)
            prompt_token_ids = output.prompt_token_ids  # the same every output: copied once
            prompt_logprobs = state.prompt_logprobs(output) or prompt_logprobs
            for completion in output.outputs:
                texts[completion.index].append(completion.text)
                token_ids[completion.index] += completion.token_ids
                if body.logprobs:
                    logprobs[completion.index] += chat_logprobs(state, completion, top_n, as_ids)
                if completion.finish_reason is not None:
                    finish[completion.index] = (completion.finish_reason, completion.stop_reason)
    choices = []
    role = response_role(state, body)
    echo = _echo(body, role)
    for i in range(n):
        reason, stop_reason = finish.get(i, ("abort", None))
        message = ChatResponseMessage(role=role, content="".join(texts[i]))
        if parsing is not None:
            parser = parsing.choice_parser()
            message = _parsed_message(parser.parse(message.content or ""), parser, role)
            reason = finish_reason(reason, parser)
        if echo:  # before the parsed content, never parsed itself (as vLLM)
            message.content = echo + (message.content or "")
        choices.append(
            ChatChoice(
                index=i,
                message=message,
                logprobs=ChatChoiceLogprobs(content=logprobs[i]) if body.logprobs else None,
                finish_reason=reason,
                stop_reason=stop_reason,
                token_ids=token_ids[i] if body.return_token_ids else None,
            )
        )
    return ChatCompletionResponse(
        id=request_id,
        model=model,
        choices=choices,
        usage=usage.info(),
        prompt_logprobs=prompt_logprobs,
        prompt_token_ids=(
            list(prompt_token_ids)
            if body.return_token_ids and prompt_token_ids is not None
            else None
        ),
    )


def _parsed_choice(
    parser: ChoiceParser,
    index: int,
    text: str,
    logprobs: ChatChoiceLogprobs | None = None,
    finish: str | None = None,
    stop_reason: int | str | None = None,
) -> dict[str, Any] | None:
    """The streamed choice of ``text``, new text of choice ``index``, after the parsers
    (flushed when ``finish`` is a finish reason); ``None`` when they hold all of it back and
    there is no finish reason or logprobs to send. Tool calls go out as the parsers report
    them: a streaming parser's calls in pieces, others whole (:func:`tool_call_delta_json`)."""
    delta = parser.feed(text)
    if finish is not None:
        delta += parser.finish()
    if not (delta or finish is not None or logprobs):
        return None
    calls = [tool_call_delta_json(fragment) for fragment in delta.fragments]
    return chat_choice(
        index,
        content=delta.content or None,
        reasoning=delta.reasoning or None,
        tool_calls=calls or None,
        logprobs=logprobs,
        finish_reason=finish_reason(finish, parser),
        stop_reason=stop_reason,
    )


async def _events(
    state: ServerState,
    body: ChatCompletionRequest,
    stream: AsyncIterator[RequestOutput],
    request_id: str,
    model: str,
    n: int,
    num_prompt_tokens: int | None,
    parsing: RequestParsing | None,
) -> AsyncIterator[str | bytes]:
    """The stream's SSE events. ``num_prompt_tokens`` is the prompt's length when the
    front-end knows it; ``None`` when only the engine's first output does (images expand
    their placeholders there): the role chunk then waits for that output."""
    created = int(time.time())
    parsers = {i: parsing.choice_parser() for i in range(n)} if parsing else None
    top_n = body.top_logprobs or 0
    as_ids = state.tokens_as_ids(body.return_tokens_as_token_ids)
    finished: set[int] = set()
    usage = state.usage_counter()
    usage.prompt_tokens[0] = num_prompt_tokens or 0  # known before the first output (role chunk)

    encoder = ChunkEncoder("chat.completion.chunk", request_id, created, model)

    def chunk(
        choices: list[dict[str, Any]], with_usage: bool, prompt_ids: list[int] | None = None
    ) -> bytes:
        return encoder.event(choices, usage.as_dict() if with_usage else None, prompt_ids)

    def ids(completion: CompletionOutput) -> list[int] | None:
        return list(completion.token_ids) if body.return_token_ids else None

    role = response_role(state, body)
    role_chunk = [chat_choice(i, role=role, content="") for i in range(n)]
    echo = _echo(body, role)

    def opening(prompt_ids: list[int] | None = None) -> list[bytes]:
        """The role chunk, then (``echo``) the echoed content, unparsed, in its own chunk."""
        # one choice per chunk, as OpenAI and vLLM send them: clients read choices[0];
        # the prompt's ids go with the first
        events = [
            chunk([role], body.continuous_usage, prompt_ids if i == 0 else None)
            for i, role in enumerate(role_chunk)
        ]
        if echo:
            events.extend(
                chunk([chat_choice(i, content=echo)], body.continuous_usage) for i in range(n)
            )
        return events

    # With return_token_ids the role chunk carries the engine's prompt ids (after any
    # truncate_prompt_tokens), and with images its usage counts the expanded prompt, so it
    # waits for the first output.
    role_sent = not body.return_token_ids and num_prompt_tokens is not None
    try:
        async with contextlib.aclosing(stream):
            if role_sent:
                for event in opening():
                    yield event
            async for output in stream:
                if not role_sent:
                    role_sent = True
                    # the engine's prompt count, but none of this output's tokens yet: the
                    # opening chunks come before them (their usage says 0 completion tokens)
                    usage.prompt_tokens[0] = len(output.prompt_token_ids)
                    prompt_ids = list(output.prompt_token_ids) if body.return_token_ids else None
                    for event in opening(prompt_ids):
                        yield event
                usage.add(0, output)
                choices = []
                for completion in output.outputs:
                    if not (completion.text or completion.token_ids or completion.finished):
                        continue
                    logprobs = None
                    if body.logprobs:
                        logprobs = ChatChoiceLogprobs(
                            content=chat_logprobs(state, completion, top_n, as_ids)
                        )
                    if completion.finished:
                        finished.add(completion.index)
                    if parsers is None:
                        choice = chat_choice(
                            completion.index,
                            content=completion.text,
                            logprobs=logprobs,
                            finish_reason=completion.finish_reason,
                            stop_reason=completion.stop_reason,
                            token_ids=ids(completion),
                        )
                    else:
                        choice = _parsed_choice(
                            parsers[completion.index],
                            completion.index,
                            completion.text,
                            logprobs,
                            completion.finish_reason,
                            completion.stop_reason,
                        )
                        if choice is None and body.return_token_ids and completion.token_ids:
                            # the text is held back by the parsers; the ids still go out
                            choice = chat_choice(completion.index)
                        if choice is None:
                            continue  # all held back by the parsers
                        if body.return_token_ids:
                            choice["token_ids"] = ids(completion)
                    choices.append(choice)
                for choice in choices:  # one per chunk, as the opening
                    yield chunk([choice], body.continuous_usage)
        if not role_sent:  # no output at all (aborted before the first)
            for event in opening():
                yield event
        # A stream that ended without a finish reason was aborted (server shutdown).
        for i in sorted(set(range(n)) - finished):
            aborted = (
                chat_choice(i, finish_reason="abort")
                if parsers is None
                else _parsed_choice(parsers[i], i, "", finish="abort")  # what they held
            )
            yield chunk([aborted], body.continuous_usage)
        if body.include_usage:
            yield chunk([], True)
    except Exception as exc:
        # Headers are sent: the error becomes an event in the stream (e.g. the engine died).
        yield sse(errors.stream_error_json(exc))
    yield SSE_DONE


async def prepare_chat(
    state: ServerState,
    body: ChatCompletionRequest,
    images: list[Any] | None = None,
    videos: list[Any] | None = None,
    audios: list[Any] | None = None,
) -> tuple[SamplingParams, list[int], RequestParsing | None]:
    """What a chat request runs as: its sampling params (400s for invalid fields), its
    rendered prompt's token ids, and how its output is parsed (``None``: all content), the
    params adjusted to the parsing (special tokens kept for a tool parser that reads them,
    a JSON constraint applied after the reasoning). The messages' images are appended to
    ``images`` when it is given (chat completions, and ``/v1/responses``, which shares this
    and sends its images as loaded ``image_pil`` parts); without it image parts are a 400.
    Their videos (audio clips) are appended to ``videos`` (``audios``) likewise (chat
    completions only)."""
    params = body.to_sampling_params(state.sampling_defaults, max_model_len=state.max_model_len)
    check_max_logprobs(
        state.engine.config.max_logprobs,
        top_logprobs=body.top_logprobs if body.logprobs else None,
        prompt_logprobs=body.prompt_logprobs,
    )
    prompt_text, prompt_ids = await _prompt(state, body, images, videos, audios)
    parsing = state.parsers.for_request(
        body, state.tokenizer, prompt_text, params.structured_outputs
    )
    if parsing is not None and parsing.needs_special_tokens:
        params = params.clone(skip_special_tokens=False)
    if parsing is not None and parsing.constrained_after_reasoning:
        assert params.structured_outputs is not None
        params = params.clone(
            structured_outputs=msgspec.structs.replace(
                params.structured_outputs, after_reasoning=True
            )
        )
    return params, prompt_ids, parsing


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    """OpenAI's chat completions API."""
    state = _state(request)
    state.check_accepting()
    model, lora_request = state.resolve_model(body.model)
    if state.settings.enable_force_include_usage:
        body.force_include_usage()
    images: list[Any] = []
    videos: list[Any] = []
    audios: list[Any] = []
    params, prompt_ids, parsing = await prepare_chat(state, body, images, videos, audios)
    # (mm_processor_kwargs without media are ignored, as vLLM ignores them)
    multi_modal_data: dict[str, list[Any]] = {}
    if images:
        multi_modal_data["image"] = images
    if videos:
        multi_modal_data["video"] = videos
    if audios:
        multi_modal_data["audio"] = audios
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    log_request(state.settings, request_id, None, prompt_ids, params, lora_request, state.tokenizer)
    n = params.n
    priority = body.priority or 0
    if body.use_beam_search:  # vLLM's beam search (serve/beam_search.py)
        if multi_modal_data:
            raise errors.bad_request(
                f"beam search does not take {' or '.join(multi_modal_data)} inputs yet; send "
                "the request without use_beam_search",
                "use_beam_search",
            )
        return await beam_search_response(
            request,
            state,
            body,
            [prompt_ids],
            params,
            request_id,
            lora_request,
            lambda streams: _collect(state, streams[0], body, request_id, model, n, parsing),
        )

    def open_stream() -> Awaitable[AsyncIterator[RequestOutput]]:
        return state.open_stream(
            prompt_ids,
            params,
            request_id,
            priority,
            lora_request,
            body.cache_salt,
            multi_modal_data=multi_modal_data or None,
            mm_processor_kwargs=body.mm_processor_kwargs,
        )

    return await generation_response(
        request,
        body.stream,
        structured_request.naming_tools(open_stream) if body.forces_tool_calls else open_stream,
        lambda stream: _events(
            state,
            body,
            stream,
            request_id,
            model,
            n,
            None if multi_modal_data else len(prompt_ids),  # (media: the engine's count)
            parsing,
        ),
        lambda stream: _collect(state, stream, body, request_id, model, n, parsing),
    )
