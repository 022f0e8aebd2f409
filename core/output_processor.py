"""Engine-core outputs (token ids per step) -> ``RequestOutput``s (text, logprobs, metrics).

Runs in the front-end. Each parent request (one ``RequestOutput``) has one child per
completion (``n``); the engine core only knows children. Stop strings are applied here, so a
child that hits one is finished here first and reported in ``request_ids_to_abort`` for the
engine core to drop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from chassis.core.detokenizer import IncrementalDetokenizer
from chassis.core.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from chassis.core.pooling_outputs import EmbeddingOutput, EmbeddingRequestOutput, decode_pooled
from chassis.core.request import FinishReason
from chassis.core.stat_logger import FinishedRequestStats, IterationStats

if TYPE_CHECKING:
    from collections.abc import Sequence

    from transformers import PreTrainedTokenizerBase

    from chassis.core.request import (
        EngineCoreOutput,
        EngineCoreOutputs,
        RequestError,
        TokenLogprobs,
    )
    from chassis.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class ProcessedOutputs:
    """The result of one ``OutputProcessor.process_outputs`` call."""

    #: one per parent request that made progress, in the order first touched (then one per
    #: pooling request that finished)
    request_outputs: list[RequestOutput | EmbeddingRequestOutput] = field(default_factory=list)
    #: child (engine-core) request ids finished by a stop string: abort them in the engine
    request_ids_to_abort: list[str] = field(default_factory=list)
    #: what the step produced, for the stat loggers (``chassis.core.stat_logger``)
    iteration_stats: IterationStats = field(default_factory=IterationStats)


class _TokenIdsOnly:
    """Stands in for ``IncrementalDetokenizer`` when there is no tokenizer: keeps the ids,
    produces no text and never matches a stop string (the input processor rejects those)."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.stop_reason: str | None = None
        self.streamed_text = ""

    def update(
        self,
        new_token_ids: Sequence[int],
        *,
        finished: bool = False,
        stop_token_terminated: bool = False,
    ) -> str:
        self.token_ids.extend(new_token_ids)
        return ""


class _Completion:
    """Front-end state of one child request (one completion of a parent)."""

    def __init__(
        self,
        index: int,
        detokenizer: IncrementalDetokenizer | _TokenIdsOnly,
        want_logprobs: bool,
    ) -> None:
        self.index = index
        self.detokenizer = detokenizer
        self.logprobs: list[PositionLogprobs] | None = [] if want_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if want_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: RequestError | None = None
        # Delta mode: what has not been yielded yet.
        self.pending_text = ""
        self.num_tokens_sent = 0
        self.has_progress = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def delta_output(self) -> CompletionOutput:
        """What is new since the previous delta (and mark it sent)."""
        start = self.num_tokens_sent
        token_ids = self.detokenizer.token_ids[start:]
        out = CompletionOutput(
            index=self.index,
            text=self.pending_text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else self.logprobs[start:],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            error=self.error,
        )
        self.pending_text = ""
        self.num_tokens_sent += len(token_ids)
        return out

    def cumulative_output(self) -> CompletionOutput:
        """Everything so far (text without the characters held back for stop strings)."""
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.streamed_text,
            token_ids=list(self.detokenizer.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            error=self.error,
        )


class _ParentRequest:
    """Front-end state of one request as the caller sees it."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        completions: dict[str, _Completion],
        arrival_time: float,
        delta: bool,
        final_only: bool = False,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        #: child request id -> completion, in index order
        self.completions = completions
        self.delta = delta
        self.final_only = final_only
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.prompt_logprobs_sent = False
        self.num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions.values())

    def make_output(self) -> RequestOutput:
        finished = self.finished
        if self.delta:
            outputs = [c.delta_output() for c in self.completions.values() if c.has_progress]
            prompt_logprobs = None if self.prompt_logprobs_sent else self.prompt_logprobs
        else:
            outputs = [c.cumulative_output() for c in self.completions.values()]
            prompt_logprobs = self.prompt_logprobs
        self.prompt_logprobs_sent = self.prompt_logprobs is not None
        for c in self.completions.values():
            c.has_progress = False
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            # a snapshot: the caller may read it after later steps updated ours
            metrics=replace(self.metrics),
        )


class OutputProcessor:
    """Tracks every running request in the front-end and turns engine outputs into results.

    Not thread-safe: call it from one thread (the output handler task of ``AsyncLLM``, or the
    loop of the offline ``LLM``). With ``tokenizer=None`` (``skip_tokenizer_init``) outputs
    carry token ids with empty text, logprobs have no ``decoded_token``, and stop strings
    are refused.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _ParentRequest] = {}
        #: child request id -> parent request id
        self._child_to_parent: dict[str, str] = {}
        #: pooling request id -> (prompt text, prompt token ids, arrival time)
        self._pooling: dict[str, tuple[str | None, list[int], float]] = {}
        self._token_text: dict[int, str] = {}

    # -- bookkeeping ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        child_request_ids: list[str],
        arrival_time: float | None,
        delta: bool,
        *,
        final_only: bool = False,
    ) -> None:
        """Start tracking a request whose children were sent to the engine core.

        ``child_request_ids`` are the engine-core ids in completion-index order (``[request_id]``
        when ``n == 1``). ``delta``: yield only what is new (streaming) instead of the full
        state. ``final_only`` (with ``delta=False``): yield one output, the full state once
        every completion finished, and none per step (the offline ``LLM``: building the full
        state of every request at every step costs time that grows with the output length).
        Raises ``ValueError`` if an id is already tracked or both modes are asked for.
        """
        if delta and final_only:
            raise ValueError("final_only outputs are whole (delta=False), not deltas")
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already running")
        if not child_request_ids:
            raise ValueError(f"request {request_id!r} needs at least one child request id")
        taken = [c for c in child_request_ids if c in self._child_to_parent]
        if taken:
            raise ValueError(f"child request ids already running: {taken}")
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer (this engine runs without one)")
        want_logprobs = params.logprobs is not None
        completions = {
            child_id: _Completion(index, self._detokenizer(params, final_only), want_logprobs)
            for index, child_id in enumerate(child_request_ids)
        }
        self._parents[request_id] = _ParentRequest(
            request_id,
            prompt,
            list(prompt_token_ids),
            completions,
            time.time() if arrival_time is None else arrival_time,
            delta,
            final_only,
        )
        for child_id in child_request_ids:
            self._child_to_parent[child_id] = request_id

    def add_pooling_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        arrival_time: float | None = None,
    ) -> None:
        """Start tracking a pooling request (its engine-core id is ``request_id``; it arrived
        at ``arrival_time``, ``time.time()``, default now); its one output, an
        :class:`EmbeddingRequestOutput`, comes when the engine finishes it. Raises
        ``ValueError`` if the id is already tracked."""
        if request_id in self._pooling or request_id in self._child_to_parent:
            raise ValueError(f"request id {request_id!r} is already running")
        arrival = time.time() if arrival_time is None else arrival_time
        self._pooling[request_id] = (prompt, list(prompt_token_ids), arrival)

    def _pooled_output(
        self, out: EngineCoreOutput, now: float, engine_index: int = 0
    ) -> EmbeddingRequestOutput | None:
        """The finished pooling request ``out`` (from engine core ``engine_index``) reports
        (forgotten here), or ``None``."""
        tracked = self._pooling.pop(out.request_id, None)
        if tracked is None:
            return None
        prompt, prompt_token_ids, arrival = tracked
        return EmbeddingRequestOutput(
            request_id=out.request_id,
            outputs=EmbeddingOutput(decode_pooled(out.pooled) if out.pooled else []),
            prompt_token_ids=prompt_token_ids,
            prompt=prompt,
            num_cached_tokens=out.num_cached_tokens,
            finish_reason=FinishReason(out.finish_reason).value,
            error=out.error,
            metrics=RequestMetrics(
                arrival_time=arrival,
                first_scheduled_time=out.first_scheduled_time,
                finished_time=now,
                engine_index=engine_index,
            ),
        )

    def _detokenizer(
        self, params: SamplingParams, final_only: bool
    ) -> IncrementalDetokenizer | _TokenIdsOnly:
        if self.tokenizer is None:
            return _TokenIdsOnly()
        return IncrementalDetokenizer.from_sampling_params(
            self.tokenizer, params, read_at_finish_only=final_only
        )

    def abort_request(self, request_id: str) -> list[str]:
        """Stop tracking a parent request; return its unfinished child ids (abort them in the
        engine core). Unknown ids return ``[]``."""
        parent = self._parents.get(request_id)
        if parent is None:
            return [request_id] if self._pooling.pop(request_id, None) is not None else []
        self._remove(parent)
        return [cid for cid, c in parent.completions.items() if not c.finished]

    def fail_all(self, error: BaseException | str) -> list[str]:
        """Forget every request (the engine died); return the parent ids so the caller can
        fail each one with ``error``."""
        request_ids = list(self._parents) + list(self._pooling)
        if request_ids:
            logger.error("failing %d running requests: %s", len(request_ids), error)
        self._parents.clear()
        self._child_to_parent.clear()
        self._pooling.clear()
        return request_ids

    def has_unfinished(self) -> bool:
        """Whether any parent (or pooling) request is still tracked."""
        return bool(self._parents) or bool(self._pooling)

    @property
    def num_unfinished(self) -> int:
        return len(self._parents) + len(self._pooling)

    def _remove(self, parent: _ParentRequest) -> None:
        del self._parents[parent.request_id]
        for child_id in parent.completions:
            self._child_to_parent.pop(child_id, None)

    # -- the step ---------------------------------------------------------------------------

    def process_outputs(self, engine_core_outputs: EngineCoreOutputs) -> ProcessedOutputs:
        """Apply one batch of engine-core outputs.

        Returns one ``RequestOutput`` per parent that made progress (a ``final_only`` parent
        only when it finished; finished parents are then forgotten), one
        ``EmbeddingRequestOutput`` per pooling request that finished, and the children a stop
        string finished. Outputs for unknown or
        already finished children (aborted, or stopped here) are ignored. ``engine_error`` is
        not handled here: the caller checks it and calls ``fail_all``.
        """
        now = time.time()
        engine_index = engine_core_outputs.engine_index
        result = ProcessedOutputs(
            iteration_stats=IterationStats(timestamp=now, engine_index=engine_index)
        )
        touched: dict[str, _ParentRequest] = {}
        for out in engine_core_outputs.outputs:
            parent_id = self._child_to_parent.get(out.request_id)
            if parent_id is None:
                if self._pooling and out.finished:  # (a pooling request has no parent)
                    pooled = self._pooled_output(out, now, engine_index)
                    if pooled is not None:
                        result.request_outputs.append(pooled)
                        _count_pooled(result.iteration_stats, pooled)
                continue
            parent = self._parents[parent_id]
            completion = parent.completions[out.request_id]
            if completion.finished:
                continue
            parent.metrics.engine_index = engine_index  # (all its completions run there)
            if self._apply(parent, completion, out, now, result.iteration_stats):
                result.request_ids_to_abort.append(out.request_id)
            if not parent.final_only or parent.finished:
                touched[parent_id] = parent
        for parent in touched.values():
            finished = parent.finished
            if finished:
                parent.metrics.finished_time = now
                result.iteration_stats.finished_requests.append(_finished_stats(parent))
            result.request_outputs.append(parent.make_output())
            if finished:
                self._remove(parent)
        return result

    def _apply(
        self,
        parent: _ParentRequest,
        completion: _Completion,
        out: EngineCoreOutput,
        now: float,
        stats: IterationStats,
    ) -> bool:
        """Fold one engine output into a completion (counted in ``stats``); True if the
        engine must abort it."""
        if out.num_cached_tokens:
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
        if out.first_scheduled_time is not None and parent.metrics.first_scheduled_time is None:
            parent.metrics.first_scheduled_time = out.first_scheduled_time
        if out.prompt_logprobs is not None and parent.prompt_logprobs is None:
            parent.prompt_logprobs = [
                None if tl is None else self._position_logprobs(tl) for tl in out.prompt_logprobs
            ]
        detok = completion.detokenizer
        num_before = len(detok.token_ids)
        completion.pending_text += detok.update(
            out.new_token_ids,
            finished=out.finished,
            stop_token_terminated=out.finish_reason == FinishReason.STOP,
        )
        num_new = len(detok.token_ids) - num_before
        if completion.logprobs is not None and out.new_logprobs:
            for tl in out.new_logprobs[:num_new]:
                completion.logprobs.append(self._position_logprobs(tl))
                completion.cumulative_logprob += tl.logprobs[0]
        if num_new:
            metrics = parent.metrics
            stats.num_generation_tokens += num_new
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                # the prompt counts once its prefill is done (vLLM's prompt throughput)
                stats.num_prompt_tokens += len(parent.prompt_token_ids)
                stats.time_to_first_tokens.append(now - metrics.arrival_time)
            metrics.last_token_time = now
            metrics.num_generation_tokens += num_new
        completion.has_progress = True
        must_abort = False
        if detok.stop_reason is not None:
            completion.finish_reason = FinishReason.STOP.value
            completion.stop_reason = detok.stop_reason
            must_abort = not out.finished
        elif out.finished:
            completion.finish_reason = FinishReason(out.finish_reason).value
            completion.stop_reason = out.stop_reason
            completion.error = out.error
        return must_abort

    def _position_logprobs(self, tl: TokenLogprobs) -> PositionLogprobs:
        """The chosen token (its true rank) then the top alternatives (ranks 1, 2, ...)."""
        chosen = tl.token_ids[0]
        result: PositionLogprobs = {
            chosen: Logprob(tl.logprobs[0], tl.rank, self._decoded_token(chosen))
        }
        for rank, (token_id, logprob) in enumerate(
            zip(tl.token_ids[1:], tl.logprobs[1:], strict=True), start=1
        ):
            if token_id not in result:
                result[token_id] = Logprob(logprob, rank, self._decoded_token(token_id))
        return result

    def _decoded_token(self, token_id: int) -> str | None:
        # One token's own text (special tokens kept); partial UTF-8 bytes read as U+FFFD.
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text


def _finished_stats(parent: _ParentRequest) -> FinishedRequestStats:
    """The stat loggers' record of a parent request that just finished."""
    m = parent.metrics
    first = next(iter(parent.completions.values()))
    return FinishedRequestStats(
        request_id=parent.request_id,
        finish_reason=first.finish_reason or FinishReason.ABORT.value,
        num_prompt_tokens=len(parent.prompt_token_ids),
        num_generation_tokens=m.num_generation_tokens,
        num_cached_tokens=parent.num_cached_tokens,
        time_to_first_token=(
            None if m.first_token_time is None else m.first_token_time - m.arrival_time
        ),
        e2e_latency=m.e2e_latency,
        queue_time=m.queue_time,
    )


def _count_pooled(stats: IterationStats, pooled: EmbeddingRequestOutput) -> None:
    """A pooling request computed its prompt and finished in this step."""
    m = pooled.metrics
    stats.num_prompt_tokens += len(pooled.prompt_token_ids)
    stats.finished_requests.append(
        FinishedRequestStats(
            request_id=pooled.request_id,
            finish_reason=pooled.finish_reason,
            num_prompt_tokens=len(pooled.prompt_token_ids),
            num_generation_tokens=0,
            num_cached_tokens=pooled.num_cached_tokens,
            e2e_latency=None if m is None else m.e2e_latency,
            queue_time=None if m is None else m.queue_time,
        )
    )
