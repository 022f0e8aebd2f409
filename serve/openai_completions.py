"""``POST /v1/completions``: text (or token-id) prompts in, completions out, streamed or not.

A batch of ``P`` prompts with ``n`` completions each gives ``P * n`` choices, choice
``index = prompt_index * n + completion_index``, as OpenAI does. Each prompt is one engine
request (``n > 1`` is handled inside the engine). Text prompts are tokenized here, in a worker
thread, with the tokenizer's special tokens unless ``add_special_tokens`` is false. An engine
without a tokenizer (``--skip-tokenizer-init``) takes token-id prompts only and answers with
empty ``text`` (the usage counts are still exact).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from chassis.core.prompt_embeds import EmbedsPrompt, flag_refusal, load_base64
from chassis.serve import errors
from chassis.serve.beam_search import beam_search_response
from chassis.serve.completion_echo import (
    echo_logprobs,
    echo_text,
    with_prompt_logprobs_cut,
    without_generation,
)
from chassis.serve.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprobs,
    check_max_logprobs,
    json_logprob,
)
from chassis.serve.request_log import log_request
from chassis.serve.state import ServerState
from chassis.serve.stream_chunks import ChunkEncoder, completion_choice
from chassis.serve.streaming import (
    SSE_DONE,
    generation_response,
    merge_streams,
    sse,
)

if TYPE_CHECKING:
    from chassis.core.lora.request import LoRARequest
    from chassis.core.outputs import CompletionOutput, PositionLogprobs, RequestOutput
    from chassis.core.sampling_params import SamplingParams

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.chassis


class _LogprobBuilder:
    """Builds OpenAI's legacy completion logprobs for one choice, delta by delta."""

    def __init__(self, state: ServerState, as_ids: bool = False) -> None:
        self.state = state
        #: name tokens "token_id:ID" (--return-tokens-as-token-ids)
        self.as_ids = as_ids
        self.offset = 0

    def build(self, completion: CompletionOutput) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for token_id, position in zip(
            completion.token_ids, completion.logprobs or [], strict=False
        ):
            sampled = position.get(token_id)
            text = self.state.token_text(
                token_id, sampled.decoded_token if sampled else None, as_id=self.as_ids
            )
            out.tokens.append(text)
            out.token_logprobs.append(json_logprob(sampled.logprob) if sampled else None)
            out.top_logprobs.append(
                {
                    self.state.token_text(tid, lp.decoded_token, as_id=self.as_ids): json_logprob(
                        lp.logprob
                    )
                    for tid, lp in sorted(position.items(), key=lambda kv: kv[1].rank)
                }
            )
            out.text_offset.append(self.offset)
            self.offset += len(text)
        return out


class _Choice:
    """What is accumulated for one choice of a non-streaming response."""

    def __init__(
        self, index: int, state: ServerState, with_logprobs: bool, as_ids: bool = False
    ) -> None:
        self.index = index
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs = _LogprobBuilder(state, as_ids) if with_logprobs else None
        self.merged = CompletionLogprobs() if with_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.prompt_logprobs: PromptLogprobs | None = None

    def add(self, completion: CompletionOutput) -> None:
        self.text.append(completion.text)
        self.token_ids += completion.token_ids
        if self.logprobs is not None and self.merged is not None:
            _extend(self.merged, self.logprobs.build(completion))
        if completion.finish_reason is not None:
            self.finish_reason = completion.finish_reason
            self.stop_reason = completion.stop_reason

    def result(
        self, echo: _Echo | None = None, prompt_token_ids: list[int] | None = None
    ) -> CompletionChoice:
        """The choice; with ``echo``, its prompt (and the prompt's logprobs) first; with
        ``prompt_token_ids`` (``return_token_ids``), those and the generated ids."""
        text = "".join(self.text)
        logprobs = self.merged
        if echo is not None:
            text = echo.text + text
            if logprobs is not None and echo.logprobs is not None:
                logprobs = echo.logprobs_before(logprobs)
        return CompletionChoice(
            index=self.index,
            text=text,
            logprobs=logprobs,
            # a stream that ended without a finish reason was aborted (e.g. on shutdown)
            finish_reason=self.finish_reason or "abort",
            stop_reason=self.stop_reason,
            prompt_logprobs=self.prompt_logprobs,
            prompt_token_ids=prompt_token_ids,
            token_ids=None if prompt_token_ids is None else self.token_ids,
        )


def _extend(into: CompletionLogprobs, part: CompletionLogprobs, shift: int = 0) -> None:
    """Append ``part``'s entries to ``into``, their text offsets moved by ``shift``."""
    into.tokens += part.tokens
    into.token_logprobs += part.token_logprobs
    into.top_logprobs += part.top_logprobs
    into.text_offset += [o + shift for o in part.text_offset]


class _Echo:
    """The prompt part of each choice of one prompt (``echo``)."""

    def __init__(
        self,
        state: ServerState,
        prompt: str | list[int] | None,
        prompt_token_ids: list[int],
        prompt_logprobs: list[PositionLogprobs | None] | None,
        num_logprobs: int | None,
        as_ids: bool = False,
    ) -> None:
        """``prompt``: as the client sent it; ``None`` to echo the engine's token ids (a
        truncated prompt)."""
        self.text = echo_text(state, prompt_token_ids if prompt is None else prompt)
        self.logprobs = (
            None
            if num_logprobs is None
            else echo_logprobs(
                state, prompt_token_ids, prompt_logprobs, num_logprobs, as_ids=as_ids
            )
        )
        #: where the completion's text offsets start: after the prompt's token texts
        self.logprobs_text_length = (
            0 if self.logprobs is None else sum(len(t) for t in self.logprobs.tokens)
        )

    def logprobs_before(self, completion: CompletionLogprobs) -> CompletionLogprobs:
        """The prompt's logprobs followed by ``completion``'s (offsets from 0)."""
        out = CompletionLogprobs()
        if self.logprobs is not None:
            _extend(out, self.logprobs)
        _extend(out, completion, self.logprobs_text_length)
        return out


def _echo(
    state: ServerState,
    body: CompletionRequest,
    prompts: list[str | list[int]] | None,
    prompt_index: int,
    output: RequestOutput,
) -> _Echo:
    """The echo of prompt ``prompt_index`` (``prompts``: as sent, or ``None`` for the
    engine's ids), from ``output``, the one :func:`_remember_prompt` recorded for it."""
    return _Echo(
        state,
        None if prompts is None else prompts[prompt_index],
        output.prompt_token_ids,
        output.prompt_logprobs,
        body.logprobs,
        state.tokens_as_ids(body.return_tokens_as_token_ids),
    )


async def _prompt_batch(state: ServerState, body: CompletionRequest) -> list[str | list[int]]:
    prompts = body.prompts()
    add_special = body.add_special_tokens is not False

    def tokenize() -> list[str | list[int]]:
        return [
            state.renderer.tokenize(p, add_special_tokens=add_special) if isinstance(p, str) else p
            for p in prompts
        ]

    # Without a tokenizer (--skip-tokenizer-init) text goes on as is: the engine's input
    # processor rejects it with a 400 that says to send token ids.
    if state.tokenizer is None or not any(isinstance(p, str) for p in prompts):
        return prompts
    return await asyncio.to_thread(tokenize)


def _embeds_prompts(state: ServerState, body: CompletionRequest) -> list[EmbedsPrompt]:
    """``prompt_embeds``' prompts, loaded (core/prompt_embeds.py); a 400 naming the field
    without ``--enable-prompt-embeds``, for a bad payload, and with ``echo`` or beam search
    (which read the prompt's tokens). The tensors are checked by the input processor."""
    if not getattr(state.engine.config, "enable_prompt_embeds", False):
        raise errors.bad_request(flag_refusal(), "prompt_embeds")
    if body.echo or body.use_beam_search:
        what = "echo" if body.echo else "use_beam_search"
        raise errors.bad_request(
            f"{what} cannot be combined with prompt_embeds (the prompt has no tokens)",
            "prompt_embeds",
        )
    try:
        return [EmbedsPrompt(load_base64(item)) for item in body.embeds_items()]
    except ValueError as exc:
        raise errors.bad_request(str(exc), "prompt_embeds") from None


def _remember_prompt(
    firsts: dict[int, RequestOutput], prompt_index: int, output: RequestOutput
) -> RequestOutput:
    """Record ``output`` in ``firsts`` if it is prompt ``prompt_index``'s first or carries
    the prompt logprobs (the engine sends them once, in one output, which may hold only
    some of the prompt's choices); return the recorded one."""
    if output.prompt_logprobs is not None or prompt_index not in firsts:
        firsts[prompt_index] = output
    return firsts[prompt_index]


async def _collect(
    state: ServerState,
    body: CompletionRequest,
    prompts: list[str | list[int]] | None,
    streams: list[AsyncIterator[RequestOutput]],
    request_id: str,
    model: str,
    n: int,
) -> CompletionResponse:
    with_logprobs = body.logprobs is not None
    as_ids = state.tokens_as_ids(body.return_tokens_as_token_ids)
    choices = {
        p * n + i: _Choice(p * n + i, state, with_logprobs, as_ids)
        for p in range(len(streams))
        for i in range(n)
    }
    usage = state.usage_counter()
    #: per prompt: the output with its prompt logprobs, else its first
    firsts: dict[int, RequestOutput] = {}
    async with contextlib.aclosing(merge_streams(streams)) as merged:
        async for prompt_index, output in merged:
            if body.echo_only:
                output = without_generation(output)
            usage.add(prompt_index, output)
            _remember_prompt(firsts, prompt_index, output)
            for completion in output.outputs:
                choices[prompt_index * n + completion.index].add(completion)
    echoes: dict[int, _Echo] = {}
    for p, output in firsts.items():
        if body.echo:
            echoes[p] = _echo(state, body, prompts, p, output)
        # vLLM's prompt_logprobs field only when asked for, and only as many alternatives
        # as asked for (echo may have the engine compute more)
        if body.prompt_logprobs is not None:
            prompt_logprobs = state.prompt_logprobs(
                with_prompt_logprobs_cut(output, body.prompt_logprobs)
            )
            for i in range(n):
                choices[p * n + i].prompt_logprobs = prompt_logprobs

    def prompt_ids(choice_index: int) -> list[int] | None:
        first = firsts.get(choice_index // n)
        if not body.return_token_ids or first is None:
            return None
        return list(first.prompt_token_ids)

    return CompletionResponse(
        id=request_id,
        model=model,
        choices=[choices[i].result(echoes.get(i // n), prompt_ids(i)) for i in sorted(choices)],
        usage=usage.info(),
    )


async def _events(
    state: ServerState,
    body: CompletionRequest,
    prompts: list[str | list[int]] | None,
    streams: list[AsyncIterator[RequestOutput]],
    request_id: str,
    model: str,
    n: int,
) -> AsyncIterator[str | bytes]:
    created = int(time.time())
    with_logprobs = body.logprobs is not None
    builders: dict[int, _LogprobBuilder] = {}
    finished: set[int] = set()
    #: choices that have sent a chunk: the first carries the echo and the prompt's ids
    started: set[int] = set()
    #: per prompt: the output with its prompt logprobs, else its first
    firsts: dict[int, RequestOutput] = {}
    usage = state.usage_counter()

    encoder = ChunkEncoder("text_completion", request_id, created, model)

    def chunk(choices: list[dict[str, Any]], with_usage: bool) -> bytes:
        return encoder.event(choices, usage.as_dict() if with_usage else None)

    try:
        async with contextlib.aclosing(merge_streams(streams)) as merged:
            async for prompt_index, output in merged:
                if body.echo_only:
                    output = without_generation(output)
                usage.add(prompt_index, output)
                # A choice may first show up after its prompt's first output, which alone
                # carries the prompt logprobs its echo needs.
                first = _remember_prompt(firsts, prompt_index, output)
                choices = []
                for completion in output.outputs:
                    index = prompt_index * n + completion.index
                    starting = index not in started
                    echoing = body.echo and starting  # a choice's first chunk has the echo
                    if not (
                        echoing or completion.text or completion.token_ids or completion.finished
                    ):
                        continue  # nothing to send
                    started.add(index)
                    echo = _echo(state, body, prompts, prompt_index, first) if echoing else None
                    logprobs = None
                    if with_logprobs:
                        if index not in builders:
                            builders[index] = _LogprobBuilder(
                                state, state.tokens_as_ids(body.return_tokens_as_token_ids)
                            )
                        builder = builders[index]
                        logprobs = builder.build(completion)
                        if echo is not None and echo.logprobs is not None:
                            logprobs = echo.logprobs_before(logprobs)
                            builder.offset += echo.logprobs_text_length
                    text = completion.text if echo is None else echo.text + completion.text
                    if completion.finished:
                        finished.add(index)
                    ids = body.return_token_ids
                    choices.append(
                        completion_choice(
                            index,
                            text,
                            logprobs,
                            completion.finish_reason,
                            completion.stop_reason,
                            prompt_token_ids=list(first.prompt_token_ids)
                            if ids and starting
                            else None,
                            token_ids=list(completion.token_ids) if ids else None,
                        )
                    )
                # one choice per chunk, as OpenAI and vLLM send them: clients read choices[0]
                for choice in choices:
                    yield chunk([choice], body.continuous_usage)
        # Streams that ended without a finish reason were aborted (server shutdown).
        for i in sorted(set(range(len(streams) * n)) - finished):
            yield chunk([completion_choice(i, "", finish_reason="abort")], body.continuous_usage)
        if body.include_usage:
            yield chunk([], True)
    except Exception as exc:
        # Headers are sent: the error becomes an event in the stream (e.g. the engine died).
        yield sse(errors.stream_error_json(exc))
    yield SSE_DONE


def _log_requests(
    state: ServerState,
    body: CompletionRequest,
    prompts: list[str | list[int]],
    params: SamplingParams,
    request_id: str,
    lora_request: LoRARequest | None,
) -> None:
    """``--enable-log-requests``: one line per engine request (``{id}-{i}`` in a batch, as
    :meth:`ServerState.open_streams` names them)."""
    if not state.settings.enable_log_requests:
        return
    sent = body.prompts()
    sent = [None] * (len(prompts) - len(sent)) + sent  # (prompt_embeds come first)
    for i, prompt in enumerate(prompts):
        engine_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        text = sent[i] if isinstance(sent[i], str) else None
        ids = prompt if isinstance(prompt, list) else None
        log_request(state.settings, engine_id, text, ids, params, lora_request, state.tokenizer)


@router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    """OpenAI's completions API (see the module docstring for batches and indices)."""
    state = _state(request)
    state.check_accepting()
    model, lora_request = state.resolve_model(body.model)
    if state.settings.enable_force_include_usage:
        body.force_include_usage()
    params = body.to_sampling_params(state.sampling_defaults, max_model_len=state.max_model_len)
    check_max_logprobs(
        state.engine.config.max_logprobs,
        logprobs=body.logprobs,
        prompt_logprobs=body.prompt_logprobs,
    )
    prompts: list[Any] = await _prompt_batch(state, body)
    if body.prompt_embeds is not None:  # (vLLM's order: the embeddings' prompts first)
        prompts = await asyncio.to_thread(_embeds_prompts, state, body) + prompts
    # What echo repeats: the prompts as sent, or with truncation the engine's (decoded) ids.
    originals = body.prompts() if body.truncate_prompt_tokens is None else None
    request_id = f"cmpl-{uuid.uuid4().hex}"
    _log_requests(state, body, prompts, params, request_id, lora_request)
    n = params.n
    priority = body.priority or 0
    if body.use_beam_search:  # vLLM's beam search (serve/beam_search.py)
        return await beam_search_response(
            request,
            state,
            body,
            prompts,
            params,
            request_id,
            lora_request,
            lambda streams: _collect(state, body, originals, streams, request_id, model, n),
        )
    return await generation_response(
        request,
        body.stream,
        lambda: state.open_streams(
            prompts, params, request_id, priority, lora_request, body.cache_salt
        ),
        lambda streams: _events(state, body, originals, streams, request_id, model, n),
        lambda streams: _collect(state, body, originals, streams, request_id, model, n),
    )
