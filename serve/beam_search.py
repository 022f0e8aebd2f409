"""``use_beam_search: true`` on ``/v1/completions`` and ``/v1/chat/completions`` (vLLM's field).

As in vLLM, ``n`` is the beam width and the number of choices each prompt gets (best
first), ``length_penalty`` ranks the beams (:mod:`chassis.core.beam_search`), and of the
sampling fields only ``max_tokens``, ``ignore_eos``, ``temperature`` (the request's, else
the model's default, else 1.0, as vLLM takes it), ``include_stop_str_in_output``,
``skip_special_tokens``, ``logprobs`` and ``truncate_prompt_tokens`` apply; the other
sampling fields are ignored, as vLLM ignores them. A chat request without ``max_tokens``
searches up to the context length.

The answer is never streamed: the beams are only known at the end. vLLM's completions route
answers ``stream: true`` with a plain JSON body, which a streaming client cannot read; here
it is a 400 that says so. Fields beam search cannot honour are 400s too: a structured-output
constraint, and prompt logprobs (``prompt_logprobs``, or completions' ``echo`` with
``logprobs``), which vLLM silently leaves out.

Each prompt's search runs on its own; each of its steps submits every live beam to the
engine as a one-token request, concurrently (the engine batches them). The routes' own
``_collect`` builds the response from the one finished ``RequestOutput`` per prompt that
:func:`beam_search_response` streams to it. A client that disconnects cancels the search
(the step in flight is aborted); a server shutting down ends each search at its next step
with the beams so far, finish reason ``"abort"``. The server's metrics count a search as the
one request the client sent (:func:`_record`), not as its many step requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chassis.core.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    BeamStep,
    check_prompt_fits,
    engine_step,
    run_beam_search_async,
    step_sampling_params,
)
from chassis.core.input_processor import truncate_prompt
from chassis.core.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from chassis.serve.errors import APIError, bad_request, from_value_error
from chassis.serve.state import optional_generate_kwargs
from chassis.serve.streaming import generation_response, never_streamed

if TYPE_CHECKING:
    from fastapi import Request
    from fastapi.responses import Response

    from chassis.core.lora.request import LoRARequest
    from chassis.core.sampling_params import SamplingParams
    from chassis.serve.metrics import ServerMetrics
    from chassis.serve.state import ServerState

Streams = list[AsyncIterator[RequestOutput]]


async def beam_search_response(
    request: Request,
    state: ServerState,
    body: Any,
    prompts: list[str | list[int]],
    params: SamplingParams,
    request_id: str,
    lora_request: LoRARequest | None,
    collect: Callable[[Streams], Awaitable[Any]],
) -> Response:
    """The response of a ``use_beam_search`` request: ``body`` (a completion or chat
    request, read for ``stream``, ``echo``, ``prompt_logprobs``, ``length_penalty``,
    ``priority`` and ``cache_salt``), its ``prompts`` (token ids; text only without a
    tokenizer, which is a 400), the ``params`` the route built from it, and the route's
    ``collect``, which receives one stream per prompt (ids ``{request_id}-{i}``)."""
    if body.stream:
        raise bad_request(
            "use_beam_search does not stream (the beams are only known at the end): send "
            "stream: false",
            "stream",
        )
    if params.prompt_logprobs is not None:
        # completions' echo with logprobs asks for them too: name the field that was sent
        echoed = getattr(body, "echo", False) and body.prompt_logprobs is None
        raise bad_request(
            "use_beam_search does not compute prompt logprobs (prompt_logprobs, or echo "
            "with logprobs)",
            "echo" if echoed else "prompt_logprobs",
        )
    searches = [_prepare(state, prompt, params, body.length_penalty) for prompt in prompts]
    # every step request's keywords (only those set, as the other routes pass them)
    generate_kwargs = optional_generate_kwargs(lora_request, body.cache_salt)
    if body.priority:
        generate_kwargs["priority"] = body.priority
    single = len(searches) == 1

    async def open_streams() -> Streams:
        return [
            _run(
                state,
                search,
                params,
                request_id if single else f"{request_id}-{i}",
                generate_kwargs,
            )
            for i, search in enumerate(searches)
        ]

    return await generation_response(request, False, open_streams, never_streamed, collect)


@dataclass
class _Search:
    """One prompt's validated search, not started."""

    token_ids: list[int]
    beam_params: BeamSearchParams
    step_params: SamplingParams
    eos_token_ids: list[int]


def _prepare(
    state: ServerState,
    prompt: str | list[int],
    params: SamplingParams,
    length_penalty: float | None,
) -> _Search:
    """Validate one prompt's search (a 400 ``APIError`` for what cannot run)."""
    if params.structured_outputs is not None:
        raise bad_request(
            "use_beam_search cannot follow a structured-output constraint (response_format, "
            "structured_outputs, guided_*, or a tool_choice that forces calls)",
            "use_beam_search",
        )
    if isinstance(prompt, str):
        raise bad_request(
            "this server runs without a tokenizer (--skip-tokenizer-init): send the prompt as "
            "a list of token ids",
            "prompt",
        )
    engine = state.engine
    max_model_len = engine.config.max_model_len
    eos_token_ids, vocab_size = _eos_and_vocabulary(engine)
    token_ids = _truncated(list(prompt), params, max_model_len)
    max_tokens = params.max_tokens
    if max_tokens is None:  # chat without max_tokens: up to the context length
        max_tokens = max(1, max_model_len - len(token_ids))
    try:
        beam_params = BeamSearchParams(
            beam_width=params.n,
            max_tokens=max_tokens,
            ignore_eos=params.ignore_eos,
            temperature=params.temperature,
            length_penalty=1.0 if length_penalty is None else length_penalty,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        step_params = step_sampling_params(beam_params, vocab_size, engine.config.max_logprobs)
        check_prompt_fits(len(token_ids), max_tokens, max_model_len)
    except ValueError as exc:
        raise _refusal(exc) from None
    return _Search(token_ids, beam_params, step_params, eos_token_ids)


def _eos_and_vocabulary(engine: Any) -> tuple[list[int], int | None]:
    """The ids that end a beam and the vocabulary size: the input processor's (``AsyncLLM``:
    every EOS id ordinary generation stops at); for another engine with the server's contract
    (serve/state.py), its tokenizer's EOS and length (``None``: unknown)."""
    processor = getattr(engine, "input_processor", None)
    if processor is not None:
        return list(processor.eos_token_ids), int(processor.vocab_size)
    tokenizer = engine.tokenizer
    eos = [] if tokenizer is None or tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return eos, None if tokenizer is None else len(tokenizer)


def _refusal(exc: ValueError) -> APIError:
    """The 400 of a beam search that cannot run, naming the request's field."""
    message = str(exc)
    if message.startswith("invalid beam search parameter beam_width"):
        return bad_request(f"with use_beam_search, n is the beam width: {message}", "n")
    if message.startswith("invalid beam search parameter length_penalty"):
        return bad_request(message, "length_penalty")
    return from_value_error(exc)


def _truncated(token_ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """``truncate_prompt_tokens`` as the input processor applies it (the step requests see
    the truncated prompt as theirs, so it is applied once, here): a 400 above
    ``max_model_len``; ``-1`` keeps the last ``max_model_len``."""
    try:
        return truncate_prompt(token_ids, params.truncate_prompt_tokens, max_model_len)
    except ValueError as exc:
        raise bad_request(str(exc), "truncate_prompt_tokens") from None


async def _run(
    state: ServerState,
    search: _Search,
    params: SamplingParams,
    request_id: str,
    generate_kwargs: dict[str, Any],
) -> AsyncIterator[RequestOutput]:
    """One prompt's search, its step requests sent with ``generate_kwargs``; yields its one
    finished output."""
    engine_steps = engine_step(
        state.engine.generate, search.step_params, request_id, **generate_kwargs
    )

    async def step(beams: list[BeamStep]) -> list[PositionLogprobs | None]:
        if state.shutting_down:  # end with the beams so far, as other requests end
            return [None] * len(beams)
        return await engine_steps(beams)

    beam_search = BeamSearch([search.token_ids], search.beam_params, search.eos_token_ids)
    start = time.monotonic()
    try:
        [output] = await run_beam_search_async(beam_search, step)
    except asyncio.CancelledError:  # the client went away: its choices count as aborted
        for _ in range(search.beam_params.beam_width):
            state.metrics.success("abort")
        raise
    result = to_request_output(request_id, output, params, state.engine.tokenizer)
    _record(state.metrics, result, time.monotonic() - start)
    yield result


def _record(metrics: ServerMetrics, output: RequestOutput, seconds: float) -> None:
    """Count a finished search in the server's metrics as the one request the client sent
    (its step requests go around ``ServerState``'s tracking): the prompt once, the returned
    choices' tokens and finish reasons, and its latency. No time to first token: nothing
    reaches the client before the end."""
    metrics.prompt_tokens.inc(len(output.prompt_token_ids))
    metrics.generation_tokens.inc(sum(len(c.token_ids) for c in output.outputs))
    for completion in output.outputs:
        metrics.success(completion.finish_reason or "abort")
    metrics.e2e.observe(seconds)


def to_request_output(
    request_id: str, output: BeamSearchOutput, params: SamplingParams, tokenizer: Any
) -> RequestOutput:
    """The finished ``RequestOutput`` of one prompt's search, choice ``i`` its ``i``-th best
    beam: the generated ids (the EOS that ended a beam only with
    ``include_stop_str_in_output``, as vLLM's server), their text (``skip_special_tokens``
    as asked), ``cumulative_logprob``, and with ``logprobs`` each position's ``logprobs``
    most likely tokens and the chosen one."""
    sequences = output.sequences
    prompt_ids = sequences[0].tokens[: sequences[0].num_prompt_tokens] if sequences else []
    completions = []
    for index, sequence in enumerate(sequences):
        token_ids = sequence.output_token_ids
        positions = sequence.logprobs
        if sequence.ended_on_eos and not params.include_stop_str_in_output:
            token_ids, positions = token_ids[:-1], positions[:-1]
        text = (
            ""
            if tokenizer is None
            else tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)
        )
        completions.append(
            CompletionOutput(
                index=index,
                text=text,
                token_ids=token_ids,
                cumulative_logprob=sequence.cum_logprob,
                logprobs=_cut(positions, token_ids, params.logprobs),
                finish_reason=sequence.finish_reason,
                stop_reason=sequence.stop_reason,
            )
        )
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=prompt_ids,
        outputs=completions,
        finished=True,
    )


def _cut(
    positions: list[PositionLogprobs], token_ids: list[int], num: int | None
) -> list[PositionLogprobs] | None:
    """Each position's ``num`` most likely tokens and the chosen one (``None``: not asked)."""
    if num is None:
        return None
    return [
        {tid: lp for tid, lp in position.items() if tid == chosen or lp.rank <= num}
        for position, chosen in zip(positions, token_ids, strict=True)
    ]
