"""Beam search on top of the engine, one token per step (vLLM's ``LLM.beam_search``).

The engine knows nothing of beams. Each step, every live beam (its prompt and the tokens
chosen so far) becomes an ordinary engine request for one token with the ``2 * beam_width``
most likely tokens' logprobs (:func:`step_sampling_params`). Prefix caching makes such a
request compute little: its prompt is its parent's plus one token, so every full KV block
of it is already cached. The search itself is plain Python over those logprobs
(:class:`BeamSearch`), driven by a callable that runs one step for a list of beams
(:func:`run_beam_search`, :func:`run_beam_search_async`): ``LLM`` runs the step's requests
as one batch, ``AsyncLLM`` and the API server submit them concurrently.

The rules are vLLM's (``vllm/beam_search.py`` and its ``beam_search`` methods):

- Each live beam's candidates are its returned tokens: the ``2 * beam_width`` most likely
  and, with ``temperature > 0``, the token the engine sampled (the logprobs are the model's
  own, whatever the temperature, so temperature only adds that random candidate).
- A candidate ending in an EOS token (unless ``ignore_eos``) is finished and kept aside,
  whatever its rank. The others compete for the ``beam_width`` live places by cumulative
  logprob (all have the same length within a step).
- After ``max_tokens`` steps (or when no live beam is left) the finished and live beams are
  ranked by :func:`beam_search_score`, ``cum_logprob / length ** length_penalty``, where
  ``length`` counts the prompt's tokens and the generated ones, without a final EOS; the
  best ``beam_width`` are returned, best first.

How this compares with HF transformers' ``generate(num_beams=...)`` is in docs/sampling.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from chassis.core.sampling_params import MAX_LOGPROBS, SamplingParams, is_integer

if TYPE_CHECKING:
    from chassis.core.outputs import PositionLogprobs, RequestOutput

__all__ = [
    "BeamSearch",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "BeamStep",
    "beam_search_score",
    "check_prompt_fits",
    "engine_step",
    "run_beam_search",
    "run_beam_search_async",
    "sequence_text",
    "step_logprobs",
    "step_sampling_params",
]


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: keep ``beam_width`` beams for up to ``max_tokens`` steps.

    ``ignore_eos``: EOS is an ordinary token (no beam finishes early). ``temperature``: the
    temperature of each step's one sampled token, an extra candidate (0: greedy, deterministic
    search). ``length_penalty``: the exponent of the length in :func:`beam_search_score`
    (above 0 favours longer sequences, 0 ranks by cumulative logprob alone).
    ``include_stop_str_in_output``: the EOS that finished a beam is part of its text (and,
    in the API server, of its token ids). Invalid values raise ``ValueError``.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"invalid beam search parameter {name}: {why}")

        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not is_integer(value) or value < 1:
                raise bad(name, f"must be an integer >= 1, got {value!r}")
            setattr(self, name, int(value))
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise bad(name, f"must be a number, got {value!r}")
            if not math.isfinite(value):
                raise bad(name, f"must be finite, got {value!r}")
            setattr(self, name, float(value))
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, f"must be a bool, got {getattr(self, name)!r}")


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` are the prompt's ids then the generated ones (ending with the EOS
    id when EOS finished it), as vLLM's ``LLM.beam_search`` returns them.

    ``logprobs`` holds one position per generated token: the logprobs the engine returned at
    that step (the ``2 * beam_width`` most likely tokens, and the sampled one).
    ``cum_logprob`` is the sum of the generated tokens' logprobs. ``finish_reason``:
    ``"stop"`` (EOS, whose id is ``stop_reason``), ``"length"`` (``max_tokens`` reached) or
    ``"abort"``. ``text`` is filled by the front-end that returns the sequence.
    """

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    #: how many of ``tokens`` are the prompt's
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        """The generated ids (``tokens`` after the prompt's)."""
        return self.tokens[self.num_prompt_tokens :]

    @property
    def ended_on_eos(self) -> bool:
        return self.finish_reason == "stop"

    def score(self, length_penalty: float) -> float:
        """:func:`beam_search_score` of this beam."""
        length = len(self.tokens) - (1 if self.ended_on_eos else 0)
        return beam_search_score(self.cum_logprob, length, length_penalty)


@dataclass
class BeamSearchOutput:
    """The result for one prompt: up to ``beam_width`` sequences, best score first."""

    sequences: list[BeamSearchSequence]


class BeamStep(NamedTuple):
    """One engine request of a step: continue ``token_ids`` (a beam of prompt number
    ``prompt_index``) by one token."""

    prompt_index: int
    token_ids: list[int]


def beam_search_score(cum_logprob: float, length: int, length_penalty: float) -> float:
    """vLLM's (and older HF transformers releases') length-penalised beam score:
    ``cum_logprob / length ** length_penalty``. ``length`` counts the prompt's tokens and the
    generated ones, without the EOS that finished the beam."""
    return cum_logprob / (length**length_penalty)


class _Candidate(NamedTuple):
    cum_logprob: float
    parent: BeamSearchSequence
    token_id: int
    position: PositionLogprobs


class BeamSearch:
    """The state of one beam search over several prompts (each searched on its own).

    Use: while not :attr:`finished`, run :meth:`pending` through the engine and hand the
    results to :meth:`advance`; then :meth:`outputs`. :func:`run_beam_search` does that.
    """

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        params: BeamSearchParams,
        eos_token_ids: Iterable[int],
    ) -> None:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("the prompt is empty: it must contain at least one token")
        self.params = params
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        #: per prompt: the live beams, best first
        self._live: list[list[BeamSearchSequence]] = [
            [BeamSearchSequence(tokens=[int(t) for t in p], num_prompt_tokens=len(p))]
            for p in prompts
        ]
        #: per prompt: the finished beams (EOS or abort), in the order they finished
        self._finished: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.num_steps = 0

    @property
    def finished(self) -> bool:
        """``max_tokens`` steps were run, or no prompt has a live beam left."""
        return self.num_steps >= self.params.max_tokens or not any(self._live)

    def pending(self) -> list[BeamStep]:
        """The requests of the next step: every live beam, prompt by prompt."""
        return [
            BeamStep(index, beam.tokens) for index, beams in enumerate(self._live) for beam in beams
        ]

    def advance(self, results: Sequence[PositionLogprobs | None]) -> None:
        """Extend the beams with one step's results, one per :meth:`pending` item in its
        order: the request's one-token logprobs, or ``None`` when it was aborted (which ends
        that prompt's search: its live beams finish with ``"abort"``)."""
        expected = sum(len(beams) for beams in self._live)
        if len(results) != expected:
            raise ValueError(f"got {len(results)} step results for {expected} live beams")
        start = 0
        for index, beams in enumerate(self._live):
            mine = results[start : start + len(beams)]
            start += len(beams)
            if not beams:
                continue
            if any(position is None for position in mine):
                for beam in beams:
                    beam.finish_reason = "abort"
                self._finished[index].extend(beams)
                self._live[index] = []
                continue
            self._live[index] = self._extend(index, beams, mine)  # type: ignore[arg-type]
        self.num_steps += 1

    def _extend(
        self, index: int, beams: list[BeamSearchSequence], positions: Sequence[PositionLogprobs]
    ) -> list[BeamSearchSequence]:
        """The next live beams of prompt ``index``; finished candidates go aside."""
        candidates: list[_Candidate] = []
        for beam, position in zip(beams, positions, strict=True):
            for token_id, logprob in position.items():
                candidate = _Candidate(beam.cum_logprob + logprob.logprob, beam, token_id, position)
                if token_id in self.eos_token_ids and not self.params.ignore_eos:
                    finished = _child(candidate)
                    finished.finish_reason = "stop"
                    finished.stop_reason = token_id
                    self._finished[index].append(finished)
                else:
                    candidates.append(candidate)
        # Only the kept candidates become sequences (copying every candidate's tokens would
        # cost 2 * beam_width copies of the whole sequence per beam and step). The sort is
        # stable: ties keep beam order, then the engine's order (sampled token, then rank).
        candidates.sort(key=lambda c: c.cum_logprob, reverse=True)
        return [_child(c) for c in candidates[: self.params.beam_width]]

    def outputs(self) -> list[BeamSearchOutput]:
        """Per prompt, the best ``beam_width`` of its finished and live beams by
        :meth:`BeamSearchSequence.score`, best first (ties: finished first, in the order
        they finished). Live beams are reported with finish reason ``"length"``."""
        results = []
        for finished, live in zip(self._finished, self._live, strict=True):
            for beam in live:
                beam.finish_reason = "length"
            pool = finished + live
            pool.sort(key=lambda b: b.score(self.params.length_penalty), reverse=True)
            results.append(BeamSearchOutput(sequences=pool[: self.params.beam_width]))
        return results


def _child(candidate: _Candidate) -> BeamSearchSequence:
    parent = candidate.parent
    return BeamSearchSequence(
        tokens=[*parent.tokens, candidate.token_id],
        logprobs=[*parent.logprobs, candidate.position],
        cum_logprob=candidate.cum_logprob,
        num_prompt_tokens=parent.num_prompt_tokens,
    )


# -- drivers ----------------------------------------------------------------------------------


def run_beam_search(
    search: BeamSearch,
    step: Callable[[list[BeamStep]], Sequence[PositionLogprobs | None]],
    on_step: Callable[[], None] | None = None,
) -> list[BeamSearchOutput]:
    """Run ``search`` to the end with ``step`` (one result per beam, in order; see
    :meth:`BeamSearch.advance`), calling ``on_step`` after each step (a progress bar)."""
    while not search.finished:
        search.advance(step(search.pending()))
        if on_step is not None:
            on_step()
    return search.outputs()


async def run_beam_search_async(
    search: BeamSearch,
    step: Callable[[list[BeamStep]], Awaitable[Sequence[PositionLogprobs | None]]],
) -> list[BeamSearchOutput]:
    """:func:`run_beam_search` with an awaitable ``step``."""
    while not search.finished:
        search.advance(await step(search.pending()))
    return search.outputs()


# -- the engine side --------------------------------------------------------------------------


def step_sampling_params(
    params: BeamSearchParams, vocab_size: int | None, max_logprobs: int
) -> SamplingParams:
    """The params of every step request: one token, the ``2 * beam_width`` most likely
    tokens' logprobs (all of them when the vocabulary, if known, is smaller),
    ``params.temperature``.

    Raises ``ValueError`` when the engine returns too few logprobs for the beam width
    (``--max-logprobs``, at most 20)."""
    limit = min(max_logprobs, MAX_LOGPROBS)
    num_logprobs = 2 * params.beam_width
    if vocab_size is not None:
        num_logprobs = min(num_logprobs, vocab_size)
    if num_logprobs > limit:
        # name the bound that binds: raising --max-logprobs past SamplingParams' cap is no help
        bound = (
            "--max-logprobs"
            if max_logprobs < MAX_LOGPROBS
            else "the most any request may ask for, whatever --max-logprobs"
        )
        raise ValueError(
            f"invalid beam search parameter beam_width: {params.beam_width} needs the "
            f"{num_logprobs} most likely tokens of every step, and this engine returns at "
            f"most {limit} logprobs ({bound}); use a beam width of at most {limit // 2}"
        )
    return SamplingParams(
        n=1,
        temperature=params.temperature,
        max_tokens=1,
        logprobs=num_logprobs,
        skip_special_tokens=False,
    )


def check_prompt_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """``ValueError`` unless the prompt and ``max_tokens`` generated tokens fit the context
    (the last step's request holds ``num_prompt_tokens + max_tokens - 1`` tokens and makes
    one more; checked before the search starts rather than when that step fails)."""
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} in the completion). Please reduce the length of the prompt "
            "or completion."
        )


def step_logprobs(output: RequestOutput) -> PositionLogprobs | None:
    """The one-token logprobs of a finished step request (``None`` if it was aborted)."""
    completion = output.outputs[0] if output.outputs else None
    if completion is None or completion.finish_reason == "abort" or not completion.logprobs:
        return None
    return completion.logprobs[0]


def engine_step(
    generate: Callable[..., AsyncIterator[RequestOutput]],
    params: SamplingParams,
    request_id: str,
    **generate_kwargs: Any,
) -> Callable[[list[BeamStep]], Awaitable[list[PositionLogprobs | None]]]:
    """An awaitable step over an ``AsyncLLM.generate``-like ``generate``: each beam one
    request (ids ``{request_id}-{step}-{beam}``), all awaited concurrently so the engine
    batches them. Cancelling the step closes the requests' streams, which aborts them."""
    steps = 0

    async def one(token_ids: list[int], beam_request_id: str) -> PositionLogprobs | None:
        last: RequestOutput | None = None
        stream = generate(token_ids, params, beam_request_id, delta=False, **generate_kwargs)
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            async for output in stream:
                last = output
        return None if last is None else step_logprobs(last)

    async def step(beams: list[BeamStep]) -> list[PositionLogprobs | None]:
        nonlocal steps
        steps += 1
        return list(
            await asyncio.gather(
                *(one(beam.token_ids, f"{request_id}-{steps}-{i}") for i, beam in enumerate(beams))
            )
        )

    return step


def sequence_text(tokenizer: Any, sequence: BeamSearchSequence, include_stop: bool) -> str:
    """vLLM's ``LLM.beam_search`` text: the whole sequence (prompt included) decoded with its
    special tokens, without the EOS that finished it unless ``include_stop``; ``""``
    without a tokenizer."""
    if tokenizer is None:
        return ""
    tokens = sequence.tokens
    if sequence.ended_on_eos and not include_stop:
        tokens = tokens[:-1]
    return tokenizer.decode(tokens, skip_special_tokens=False)
