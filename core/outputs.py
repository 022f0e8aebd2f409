"""What the front-end (``LLM``, ``AsyncLLM``) returns to callers, vLLM-compatible in shape."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chassis.core.request import RequestError

#: token id -> logprob of that token (the sampled one plus the top alternatives)
PositionLogprobs = dict[int, "Logprob"]


@dataclass
class Logprob:
    logprob: float
    #: 1-based rank in the full distribution
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One completion (of ``n``) of a request.

    In delta mode (streaming), ``text``, ``token_ids`` and ``logprobs`` hold only what is new
    since the previous yield for this index; otherwise everything so far.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    #: ``"stop"``, ``"length"``, ``"abort"`` or None while running
    finish_reason: str | None = None
    #: the stop string or stop token id that ended it, if any
    stop_reason: int | str | None = None
    #: why the engine ended it early (finish reason ``"abort"``), when it failed alone
    #: (``chassis.core.request.RequestError``: its ``message``, and whether the request
    #: was at fault); ``AsyncLLM.generate`` raises it as ``RequestFailedError``
    error: RequestError | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    #: when the engine core first scheduled the request (``time.time()``, like
    #: ``arrival_time``); ``first_scheduled_time - arrival_time`` is the time spent queued
    first_scheduled_time: float | None = None
    num_generation_tokens: int = 0
    #: the engine core that ran the request (data parallelism: its index; 0 with one
    #: engine), for per-engine metrics
    engine_index: int = 0

    @property
    def queue_time(self) -> float | None:
        """Arrival to the engine core's first scheduling (never negative); ``None`` before
        it was scheduled."""
        if self.first_scheduled_time is None:
            return None
        return max(0.0, self.first_scheduled_time - self.arrival_time)

    @property
    def e2e_latency(self) -> float | None:
        """Arrival to finish; ``None`` before it finished."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one request, as yielded by ``AsyncLLM.generate`` and returned by ``LLM``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


def merge_delta_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One delta-mode output equal to ``earlier`` followed by ``later`` (same request).

    For a consumer that fell behind: text, token ids and logprobs of each completion index
    are concatenated; finish and stop reasons, cumulative logprob, metrics and ``finished``
    are the later ones; prompt logprobs (sent once) come from whichever has them.
    """
    merged = {c.index: replace(c, token_ids=list(c.token_ids)) for c in earlier.outputs}
    for c in later.outputs:
        prev = merged.get(c.index)
        if prev is None:
            merged[c.index] = c
            continue
        logprobs = prev.logprobs
        if c.logprobs is not None:
            logprobs = [*(logprobs or []), *c.logprobs]
        merged[c.index] = replace(
            c,
            text=prev.text + c.text,
            token_ids=prev.token_ids + c.token_ids,
            logprobs=logprobs,
        )
    return replace(
        later,
        outputs=list(merged.values()),
        prompt_logprobs=later.prompt_logprobs
        if later.prompt_logprobs is not None
        else earlier.prompt_logprobs,
    )
