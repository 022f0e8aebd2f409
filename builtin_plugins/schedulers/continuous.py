"""``ContinuousBatchingScheduler``: the machinery shared by the built-in schedulers.

Each step (:meth:`~ContinuousBatchingScheduler.schedule`):

1. Running requests, in policy order, each get what they still need (1 token for a decode, the
   rest of the prompt for a prefill, cut to the remaining token budget when chunked prefill is
   on). If the KV cache has no room, the policy's victim is preempted (possibly the request
   itself) until it has.
2. If nothing was preempted, waiting requests are admitted in policy order while the token
   budget and ``max_num_seqs`` allow, each starting from its longest prefix-cache hit. The
   first one that does not fit stops admission (no overtaking, so no starvation), unless the
   policy lets it preempt running requests.

A request with ``bidirectional_blocks`` (Gemma 3's images: tokens that attend to each other
both ways) never gets a prefill chunk that ends strictly inside one: the chunk ends at the
block's start instead, and one that starts inside a block is planned only when the block's
rest fits the budget (:func:`~chassis.core.bidirectional_blocks.chunk_outside_blocks`).

Preemption is by recompute: the victim's blocks are freed (full computed blocks stay in the
prefix cache, so resuming is often cheap), its ``num_computed_tokens`` drops to 0, it goes back
to the waiting queue and later restarts as a new request whose prompt is its prompt plus the
tokens generated so far.

``request.num_computed_tokens`` is advanced in ``schedule()`` (as in vLLM), at the end of the
step plan, for every scheduled request: from then on it counts the tokens whose K/V exist once
the runner has executed that plan. The ``num_computed_tokens`` sent in ``NewRequestData`` and
``CachedRequestData`` is the value *before* the step: the position of the step's first token.

Async scheduling (``--async-scheduling``): ``schedule()`` for step N+1 runs before
``update_from_output`` of step N. Every plan that makes a request sample adds one to its
``num_output_placeholders``, and ``update_from_output`` takes one off when the token arrives;
planning counts those tokens as the request's (a running request with a placeholder gets a
one-token decode of it), except that a request which the placeholders alone bring to its
``max_tokens`` or to the context limit is not planned again. Tokens that arrive for a request
no longer running are dropped; preemption resets the count (the request resamples the token
when it resumes). Without async scheduling the count is 1 between ``schedule()`` and
``update_from_output`` and 0 otherwise, so one code path serves both.

Subclasses choose the policy by overriding :meth:`sort_key`, :meth:`select_victim` and
:meth:`can_preempt_for`; see docs/scheduling.md.
"""

from __future__ import annotations

import bisect
import heapq
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chassis.core.bidirectional_blocks import chunk_outside_blocks
from chassis.core.kv_cache_manager import max_group_blocks_per_request, max_tokens_per_step
from chassis.core.request import EngineCoreOutput, FinishReason, RequestStatus, SchedulerStats
from chassis.core.scheduler_interface import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    Scheduler,
    SchedulerOutput,
)
from chassis.core.speculative import NgramIndex, can_speculate
from chassis.core.stop_conditions import check_stop

if TYPE_CHECKING:
    from chassis.core.config import EngineConfig
    from chassis.core.kv_cache_manager import KVCacheManager
    from chassis.core.request import Request


@dataclass
class _StepPlan:
    """The step being planned; preemption may take requests out of it again."""

    token_budget: int
    #: request id -> tokens to compute, in scheduling order
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    #: ids to send as NewRequestData (the rest are CachedRequestData)
    new_request_ids: set[str] = field(default_factory=set)
    #: request id -> blocks taken this step (cached requests), one list per KV cache group
    new_block_ids: dict[str, list[list[int]]] = field(default_factory=dict)
    #: preempted during this step (not to be readmitted in it)
    preempted_ids: set[str] = field(default_factory=set)
    #: ids the runner must drop
    finished_request_ids: set[str] = field(default_factory=set)
    #: request id -> draft tokens it verifies this step (speculative decoding)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    def add(
        self, request_id: str, num_tokens: int, block_ids: list[list[int]], is_new: bool
    ) -> None:
        self.num_scheduled_tokens[request_id] = num_tokens
        self.token_budget -= num_tokens
        if is_new:
            self.new_request_ids.add(request_id)
        else:
            self.new_block_ids[request_id] = block_ids

    def remove(self, request_id: str) -> None:
        """Unschedule a request (preempted later in the same step), returning its tokens to the
        budget."""
        self.token_budget += self.num_scheduled_tokens.pop(request_id, 0)
        self.new_request_ids.discard(request_id)
        self.new_block_ids.pop(request_id, None)
        self.spec_token_ids.pop(request_id, None)


class ContinuousBatchingScheduler(Scheduler):
    """Continuous batching with chunked prefill, prefix caching and preemption by recompute.

    The default policy is first come, first served; subclasses override the policy hooks.

    Public state (read-only for callers): :attr:`waiting` (sorted by :meth:`sort_key`),
    :attr:`running` (in the order of the last step), :attr:`requests` (unfinished requests by
    id), :attr:`num_preemptions`.
    """

    supports_async_scheduling = True
    supports_pooling = True

    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager) -> None:
        super().__init__(config, kv_cache_manager)
        if kv_cache_manager.block_size != config.block_size:
            raise ValueError(
                f"the KV cache manager's block size ({kv_cache_manager.block_size}) differs "
                f"from --block-size ({config.block_size})"
            )
        # One request of max_model_len must fit alone: its whole context, or, when the
        # manager releases what a sliding window left, the most blocks it holds at once
        # (every KV cache group's: they share the pool).
        num_blocks = kv_cache_manager.num_usable_blocks
        capacity = num_blocks * kv_cache_manager.block_size
        if config.max_model_len is not None:
            needed = max_group_blocks_per_request(
                config.max_model_len,
                kv_cache_manager.block_size,
                kv_cache_manager.group_windows,
                max_tokens_per_step(config),
                kv_cache_manager.group_chunks,
            )
            if needed > num_blocks:
                raise ValueError(
                    f"--max-model-len {config.max_model_len} does not fit in the KV cache "
                    f"({num_blocks} blocks of {kv_cache_manager.block_size} = {capacity} "
                    f"tokens; one request holds up to {needed} blocks): give the KV cache "
                    "more memory or lower --max-model-len"
                )
        #: the context limit applied by stop conditions: max_model_len, or, when unset, what
        #: the whole KV cache holds (a longer request could never run)
        self.max_len = config.max_model_len if config.max_model_len is not None else capacity
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        #: speculative decoding (None: off) and its counters since start
        self.speculative = config.speculative
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_num_drafts = 0
        self.spec_num_accepted_tokens_per_pos = [0] * (
            self.speculative.num_speculative_tokens if self.speculative is not None else 0
        )
        # request id -> the n-gram index of its tokens (built at its first drafting step,
        # dropped when it finishes or is preempted)
        self._ngram_indexes: dict[str, NgramIndex] = {}
        #: whether drafts come from a draft model (the runner proposes them after each step)
        self._draft_model = self.speculative is not None and self.speculative.uses_draft_model
        # request id -> the drafts the draft model proposed after its last sampling step
        # (ModelRunnerOutput.draft_token_ids), dropped when it finishes or is preempted
        self._draft_proposals: dict[str, list[int]] = {}
        self._arrival_index: dict[str, int] = {}
        self._next_arrival_index = 0
        # ids the runner holds in its persistent batch (sent as NewRequestData, not yet dropped)
        self._in_runner: set[str] = set()
        # finished or aborted since the last schedule(): the runner must drop them
        self._finished_ids: set[str] = set()
        # per plan not yet given to update_from_output (by id() of its SchedulerOutput, which
        # the caller keeps alive until then): the Request objects it scheduled. Under async
        # scheduling an id can be aborted and reused while a plan with the old request is in
        # flight; results go only to the request a plan was made for.
        self._planned: dict[int, dict[str, Request]] = {}

    # -- policy hooks (override in subclasses) ---------------------------------------------

    def sort_key(self, request: Request) -> Any:
        """The policy order: smaller keys are served first and preempted last.

        Orders the waiting queue, the running requests within a step (who gets the token
        budget first) and, by default, the choice of victim. Keys must be totally ordered and
        unique per request. Default: arrival order (``arrival_index``).
        """
        return self.arrival_index(request)

    def select_victim(self, candidates: list[Request]) -> Request:
        """The running request to preempt when KV blocks run out; ``candidates`` is non-empty.

        Default: the one with the largest :meth:`sort_key`.
        """
        return max(candidates, key=self.sort_key)

    def can_preempt_for(self, request: Request, victim: Request) -> bool:
        """Whether the waiting ``request`` may preempt the running ``victim`` to be admitted.

        Default ``False``: waiting requests wait for blocks to be freed.
        """
        return False

    # -- Scheduler interface ---------------------------------------------------------------

    def arrival_index(self, request: Request) -> int:
        """The request's position in arrival (``add_request``) order, from 0."""
        return self._arrival_index[request.request_id]

    def add_request(self, request: Request) -> None:
        """Queue ``request`` (status ``WAITING``).

        Raises ``ValueError`` for a duplicate id or a prompt longer than :attr:`max_len`.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_tokens > self.max_len:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_tokens} tokens, more than "
                f"the {self.max_len} the engine accepts (--max-model-len or the KV cache size)"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._arrival_index[request.request_id] = self._next_arrival_index
        self._next_arrival_index += 1
        self._insert_waiting(request)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Finish these requests with ``FinishReason.ABORT`` and free their blocks.

        Unknown or finished ids are ignored. Ids the runner holds are reported in the next
        ``SchedulerOutput.finished_request_ids``.
        """
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.finish_reason = FinishReason.ABORT
            self._finish(request)

    def schedule(self) -> SchedulerOutput:
        """Plan the next step (see the module docstring) and advance ``num_computed_tokens``."""
        plan = _StepPlan(token_budget=self.config.max_num_batched_tokens)
        plan.finished_request_ids, self._finished_ids = self._finished_ids, set()
        self._schedule_running(plan)
        if not plan.preempted_ids:
            self._schedule_waiting(plan)
        return self._build_output(plan)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append the sampled tokens, apply :func:`check_stop`, free finished requests.

        Returns one output per request that got tokens, prompt logprobs or finished. Results for
        requests no longer running (aborted meanwhile) are dropped. Raises ``ValueError`` if the
        runner sampled for a request whose scheduled tokens did not reach its last token.
        """
        # Pooling requests the step completed finish first (the loop below then skips them).
        outputs = (
            self._finish_pooled(scheduler_output, runner_output) if runner_output.pooled else []
        )
        logprobs = runner_output.logprobs
        planned = self._planned.pop(id(scheduler_output), None)
        for i, request_id in enumerate(runner_output.request_ids):
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            if planned is not None and planned.get(request_id) is not request:
                continue  # the id now names a newer request than the one planned
            sampled = runner_output.sampled_token_ids[i]
            if request.spec_token_ids:
                self._settle_drafts(request, sampled)
            if sampled and request.num_computed_tokens < request.num_tokens:
                raise ValueError(
                    f"the model runner sampled a token for request {request_id!r} although "
                    f"only {request.num_computed_tokens} of its {request.num_tokens} tokens are "
                    "computed (a prefill chunk that does not end the prompt samples nothing)"
                )
            if sampled:
                if request.num_output_placeholders == 0:
                    raise RuntimeError(
                        f"request {request_id!r} received a token no plan made it sample"
                    )
                request.num_output_placeholders -= 1
            new_token_ids: list[int] = []
            for token_id in sampled:
                request.output_token_ids.append(token_id)
                new_token_ids.append(token_id)
                if check_stop(request, self.max_len):
                    break
            if sampled and self._draft_model:
                proposal = runner_output.draft_token_ids.get(request_id)
                if proposal and request.finish_reason is None:
                    self._draft_proposals[request_id] = proposal
                else:
                    self._draft_proposals.pop(request_id, None)
            prompt_logprobs = runner_output.prompt_logprobs.get(request_id)
            if not new_token_ids and prompt_logprobs is None:
                continue
            token_logprobs = logprobs[i] if logprobs is not None else None
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=[token_logprobs]
                    if token_logprobs is not None and new_token_ids
                    else None,
                    prompt_logprobs=prompt_logprobs,
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    first_scheduled_time=None
                    if request.first_scheduled_time_sent
                    else request.first_scheduled_time,
                )
            )
            request.first_scheduled_time_sent = True
            if request.finish_reason is not None:
                self.running.remove(request)
                self._finish(request)
        return outputs

    def _finish_pooled(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Finish (reason ``stop``, as vLLM) each pooling request the runner returned a vector
        for, with that vector as its only output. Raises ``ValueError`` for a vector of a
        request whose prompt is not computed yet."""
        outputs: list[EngineCoreOutput] = []
        planned = self._planned.get(id(scheduler_output))
        for request_id, pooled in runner_output.pooled.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            if planned is not None and planned.get(request_id) is not request:
                continue
            if request.num_computed_tokens < request.num_tokens:
                raise ValueError(
                    f"the model runner pooled request {request_id!r} after "
                    f"{request.num_computed_tokens} of its {request.num_tokens} tokens"
                )
            request.finish_reason = FinishReason.STOP
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    pooled=pooled,
                    finish_reason=FinishReason.STOP,
                    num_cached_tokens=request.num_cached_tokens,
                    first_scheduled_time=None
                    if request.first_scheduled_time_sent
                    else request.first_scheduled_time,
                )
            )
            self.running.remove(request)
            self._finish(request)
        return outputs

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    def has_finished_requests(self) -> bool:
        """Whether finished ids are pending for the runner (call ``schedule()`` once more to
        let it drop them, even with nothing unfinished)."""
        return bool(self._finished_ids)

    def stats(self) -> SchedulerStats:
        """Queue lengths, KV usage, prefix-cache counters (tokens) and preemptions so far."""
        kv = self.kv_cache_manager
        stats = SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted_tokens,
            spec_num_drafts=self.spec_num_drafts,
            spec_num_accepted_tokens_per_pos=list(self.spec_num_accepted_tokens_per_pos),
        )
        if self.config.enable_lora:
            stats.max_loras = self.config.max_loras
            stats.running_lora_adapters = _adapter_names(self.running)
            stats.waiting_lora_adapters = _adapter_names(self.waiting)
        return stats

    # -- planning --------------------------------------------------------------------------

    def _schedule_running(self, plan: _StepPlan) -> None:
        self.running.sort(key=self.sort_key)
        for request in list(self.running):
            if plan.token_budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if self._finishes_in_flight(request):
                continue  # its last token is in flight; nothing more to compute
            num_new = (
                request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
            )
            if num_new <= 0:
                continue
            if num_new > plan.token_budget:
                if not self.config.enable_chunked_prefill:
                    continue
                num_new = plan.token_budget
            if request.bidirectional_blocks:  # (never end a chunk inside an image block)
                num_new = chunk_outside_blocks(
                    request.num_computed_tokens, num_new, request.bidirectional_blocks
                )
                if num_new == 0:
                    continue  # the rest of its block waits for a step with room
            drafts = self._drafts(request, plan.token_budget) if num_new == 1 else []
            lookahead = self._lookahead(
                request, request.num_computed_tokens + num_new + len(drafts)
            )
            while True:
                block_ids = self.kv_cache_manager.allocate_group_slots(
                    request, num_new + len(drafts) + lookahead
                )
                if block_ids is None and (drafts or lookahead):
                    drafts, lookahead = [], 0  # no room to verify or draft: decode plainly
                    continue
                if block_ids is not None:
                    plan.add(request.request_id, num_new + len(drafts), block_ids, is_new=False)
                    if drafts:
                        plan.spec_token_ids[request.request_id] = drafts
                    break
                victim = self.select_victim(self._victim_candidates(self.running))
                self._preempt(victim, plan)
                if victim is request:
                    break

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        # Requests whose LoRA adapter cannot join the batch (--max-loras others run) step
        # aside for the ones behind them, and go back in their place afterwards.
        blocked: list[Request] = []
        try:
            self._admit_waiting(plan, blocked)
        finally:
            if blocked:
                # One merge of two sorted lists (an insort each costs O(queue) per request,
                # every step, when many requests wait for their adapter's turn).
                self.waiting[:] = list(heapq.merge(blocked, self.waiting, key=self.sort_key))

    def _admit_waiting(self, plan: _StepPlan, blocked: list[Request]) -> None:
        kv = self.kv_cache_manager
        # the running requests' adapters, kept up to date below (not recomputed per waiting
        # request: O(running) each, every step)
        loras = self._running_loras()
        while (
            self.waiting and plan.token_budget > 0 and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            if request.request_id in plan.preempted_ids:
                break
            if not self._lora_fits(request, loras):
                blocked.append(self.waiting.pop(0))
                continue
            hit_block_ids, num_hit_tokens = kv.get_computed_group_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if num_new > plan.token_budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = plan.token_budget
            if request.bidirectional_blocks:
                num_new = chunk_outside_blocks(
                    num_hit_tokens, num_new, request.bidirectional_blocks
                )
                if num_new == 0:
                    break  # (no overtaking: it waits for a step with room for its block)
            lookahead = self._lookahead(request, num_hit_tokens + num_new)
            block_ids = kv.allocate_group_slots(
                request, num_new + lookahead, hit_block_ids, num_hit_tokens
            )
            if block_ids is None and lookahead:  # no room to draft: admit it without
                block_ids = kv.allocate_group_slots(request, num_new, hit_block_ids, num_hit_tokens)
            while block_ids is None:
                victims = [
                    r
                    for r in self._victim_candidates(self.running)
                    if self.can_preempt_for(request, r)
                ]
                if not victims:
                    return
                self._preempt(self.select_victim(victims), plan)
                loras = self._running_loras()
                block_ids = kv.allocate_group_slots(request, num_new, hit_block_ids, num_hit_tokens)
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
            request.num_computed_tokens = num_hit_tokens
            self.running.append(request)
            if request.lora_int_id:
                loras.add(request.lora_int_id)
            plan.add(request.request_id, num_new, block_ids, is_new=True)

    def _running_loras(self) -> set[int]:
        """The LoRA adapter ids of the running requests (none without ``--enable-lora``,
        which is then not worth a pass over them)."""
        if not self.config.enable_lora:
            return set()
        return {r.lora_int_id for r in self.running if r.lora_int_id}

    def _lora_fits(self, request: Request, running_loras: set[int]) -> bool:
        """Whether ``request``'s LoRA adapter (if any) may run beside ``running_loras``
        (:meth:`_running_loras`): one of them, or they are fewer than ``--max-loras``."""
        lora_id = request.lora_int_id
        return not lora_id or lora_id in running_loras or len(running_loras) < self.config.max_loras

    def _build_output(self, plan: _StepPlan) -> SchedulerOutput:
        output = SchedulerOutput(finished_request_ids=plan.finished_request_ids)
        planned: dict[str, Request] = {}
        if plan.num_scheduled_tokens:
            self._planned[id(output)] = planned
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self.requests[request_id]
            if request_id in plan.new_request_ids:
                output.new_requests.append(
                    NewRequestData(
                        request_id=request_id,
                        prompt_token_ids=list(request.prompt_token_ids),
                        output_token_ids=list(request.output_token_ids),
                        sampling_params=request.sampling_params,
                        block_ids=self.kv_cache_manager.get_group_block_ids(request_id),
                        num_computed_tokens=request.num_computed_tokens,
                        eos_token_ids=request.eos_token_ids,
                        lora_request=request.lora_request,
                        pooling_params=request.pooling_params,
                        num_null_blocks=self.kv_cache_manager.group_num_null_blocks(request_id),
                        mm_features=request.mm_features,
                        prompt_embeds=request.prompt_embeds,
                    )
                )
                self._in_runner.add(request_id)
            else:
                output.cached_requests.append(
                    CachedRequestData(
                        request_id=request_id,
                        new_block_ids=plan.new_block_ids[request_id],
                        num_computed_tokens=request.num_computed_tokens,
                        num_null_blocks=self.kv_cache_manager.group_num_null_blocks(request_id),
                    )
                )
            output.num_scheduled_tokens[request_id] = num_tokens
            drafts = plan.spec_token_ids.get(request_id)
            if drafts:
                request.spec_token_ids = output.spec_token_ids[request_id] = drafts
            elif request.spec_token_ids:  # (no new list per request and step when empty)
                request.spec_token_ids = []
            planned[request_id] = request
            request.num_computed_tokens += num_tokens
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                # This step samples the request's next token: unknown until update_from_output.
                request.num_output_placeholders += 1
        return output

    def _drafts(self, request: Request, token_budget: int) -> list[int]:
        """Draft tokens for a decoding request (speculative decoding; ``[]`` when off, not
        eligible, or nothing to propose). They never take the request past ``max_tokens`` or
        the context, and fit the step's token budget with the decode itself. N-gram drafts
        come from the request's :class:`NgramIndex`; a draft model's are what the runner
        proposed after the request's last sampling step (``draft_token_ids``)."""
        spec = self.speculative
        if spec is None or request.num_output_placeholders:
            return []
        params = request.sampling_params
        if not can_speculate(params, len(request.output_token_ids)):
            return []
        room = min(spec.num_speculative_tokens, token_budget - 1)
        room = min(room, self.max_len - request.num_tokens - 1)
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - len(request.output_token_ids) - 1)
        if room < 1:
            return []
        if self._draft_model:
            return self._draft_proposals.get(request.request_id, [])[:room]
        index = self._ngram_indexes.get(request.request_id)
        if index is None:
            index = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max)
            self._ngram_indexes[request.request_id] = index
        # only the tokens known since its last drafting step (never drafts: they are not yet
        # tokens), so the cost per step does not grow with the context
        index.catch_up(request.prompt_token_ids, request.output_token_ids)
        return index.propose(room)

    def _lookahead(self, request: Request, num_tokens_after: int) -> int:
        """KV slots to reserve beyond a step that leaves ``num_tokens_after`` tokens of
        ``request`` computed (draft model only): the draft model writes the K/V of the next
        step's drafts at the positions right after the newest token, up to
        ``num_speculative_tokens`` of them (``core/draft_model.py``). 0 when the step does
        not make the request sample, it may not speculate, or nothing would be drafted."""
        spec = self.speculative
        if not self._draft_model or spec is None or num_tokens_after < request.num_tokens:
            return 0
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if not can_speculate(params, num_output + 1):
            return 0
        room = min(spec.num_speculative_tokens, self.max_len - num_tokens_after)
        if params.max_tokens is not None:
            # the step's token is output number num_output + 1; a verify step after it
            # needs one more output to be allowed after its drafts
            room = min(room, params.max_tokens - num_output - 2)
        return max(room, 0)

    def _settle_drafts(self, request: Request, sampled: list[int]) -> None:
        """Take back the K/V positions of the drafts the model did not agree with: the
        step computed the last token and every draft; ``sampled`` is the accepted drafts
        plus the model's own next token."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        accepted = len(sampled) - 1
        if not 0 <= accepted <= len(drafts) or sampled[:accepted] != drafts[:accepted]:
            raise RuntimeError(
                f"request {request.request_id!r}: the runner returned {sampled} for the drafts "
                f"{drafts}; it must return the drafts it accepted plus one token"
            )
        request.num_computed_tokens -= len(drafts) - accepted
        self.spec_num_draft_tokens += len(drafts)
        self.spec_num_accepted_tokens += accepted
        if drafts:
            self.spec_num_drafts += 1
            per_pos = self.spec_num_accepted_tokens_per_pos
            if len(per_pos) < len(drafts):  # never: drafts are at most num_speculative_tokens
                per_pos.extend([0] * (len(drafts) - len(per_pos)))
            for position in range(accepted):
                per_pos[position] += 1

    def _victim_candidates(self, running: list[Request]) -> list[Request]:
        """``running`` without the requests whose tokens in flight finish them (async
        scheduling): preempting one would recompute it all for a token it already has. All of
        ``running`` when that leaves none."""
        keep = [r for r in running if not self._finishes_in_flight(r)]
        return keep or list(running)

    def _finishes_in_flight(self, request: Request) -> bool:
        """Whether tokens already in flight (async scheduling) bring ``request`` to
        ``max_tokens`` or to the context limit: it stops when they arrive, so planning more
        would be wasted."""
        placeholders = request.num_output_placeholders
        if not placeholders:
            return False
        max_tokens = request.sampling_params.max_tokens
        return (
            max_tokens is not None and len(request.output_token_ids) + placeholders >= max_tokens
        ) or request.num_tokens + placeholders >= self.max_len

    # -- state changes ---------------------------------------------------------------------

    def _insert_waiting(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=self.sort_key)

    def _preempt(self, victim: Request, plan: _StepPlan) -> None:
        """Preempt ``victim`` by recompute; it rejoins the waiting queue in policy order."""
        self.running.remove(victim)
        plan.remove(victim.request_id)
        plan.preempted_ids.add(victim.request_id)
        # num_computed_tokens is not yet advanced for this step, so free() registers only
        # blocks whose K/V really exist.
        self.kv_cache_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_output_placeholders = 0  # tokens in flight for it are dropped
        victim.num_preemptions += 1
        self._ngram_indexes.pop(victim.request_id, None)  # rebuilt if it drafts again
        self._draft_proposals.pop(victim.request_id, None)  # proposed again once it samples
        self.num_preemptions += 1
        if victim.request_id in self._in_runner:
            self._in_runner.discard(victim.request_id)
            plan.finished_request_ids.add(victim.request_id)
        self._insert_waiting(victim)

    def _finish(self, request: Request) -> None:
        """Mark finished (``finish_reason`` already set), free blocks, forget the request."""
        request.status = RequestStatus.FINISHED
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        del self._arrival_index[request.request_id]
        self._ngram_indexes.pop(request.request_id, None)
        self._draft_proposals.pop(request.request_id, None)
        if request.request_id in self._in_runner:
            self._in_runner.discard(request.request_id)
            self._finished_ids.add(request.request_id)


def _adapter_names(requests: list[Request]) -> list[str]:
    """The LoRA adapters of ``requests``, by name, sorted, each once."""
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})
