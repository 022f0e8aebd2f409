"""The built-in schedulers (fcfs, priority) and the stop conditions, with a fake model runner.

The fake runner keeps a persistent batch like the real one (built from the SchedulerOutput
diffs) and a fake paged KV cache: each computed token writes ``(position, token id)`` into the
slot its block table gives. It "samples" the next token as a function of the context it reads
back *from that cache* through the block table, so a wrong block table, a lost prefix-cache
block or a bad preemption changes the token stream.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from chassis.builtin_plugins.schedulers import chassis_register_schedulers
from chassis.builtin_plugins.schedulers.continuous import ContinuousBatchingScheduler
from chassis.builtin_plugins.schedulers.fcfs import FcfsScheduler
from chassis.builtin_plugins.schedulers.priority import PriorityScheduler
from chassis.core.config import EngineConfig
from chassis.core.kv_cache_manager import KVCacheManager
from chassis.core.request import (
    EngineCoreOutput,
    FinishReason,
    Request,
    RequestStatus,
    TokenLogprobs,
)
from chassis.core.sampling_params import SamplingParams
from chassis.core.scheduler_interface import ModelRunnerOutput, SchedulerOutput
from chassis.core.stop_conditions import check_stop
from chassis.plugins.registry import Registry

VOCAB = 997


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic function of the whole context."""
    acc = len(context)
    for token in context:
        acc = (acc * 31 + token + 7) % 1_000_003
    return acc % VOCAB


@dataclass
class _RunnerRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class FakeRunner:
    """A model runner without a model (see the module docstring)."""

    block_size: int
    want_prompt_logprobs: set[str] = field(default_factory=set)
    batch: dict[str, _RunnerRequest] = field(default_factory=dict)
    kv: dict[int, tuple[int, int]] = field(default_factory=dict)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in so.finished_request_ids:
            self.batch.pop(request_id, None)
        for new in so.new_requests:
            assert new.request_id not in self.batch
            self.batch[new.request_id] = _RunnerRequest(
                new.prompt_token_ids + new.output_token_ids,
                list(new.block_ids[0]),  # one KV cache group
                new.num_computed_tokens,
            )
        for cached in so.cached_requests:
            state = self.batch[cached.request_id]
            assert state.num_computed_tokens == cached.num_computed_tokens
            state.block_ids.extend(cached.new_block_ids[0])
        assert set(so.num_scheduled_tokens) == {r.request_id for r in so.new_requests} | {
            r.request_id for r in so.cached_requests
        }
        out = ModelRunnerOutput(logprobs=[])
        for request_id, num_tokens in so.num_scheduled_tokens.items():
            state = self.batch[request_id]
            start = state.num_computed_tokens
            for pos in range(start, start + num_tokens):
                self.kv[self._slot(state, pos)] = (pos, state.token_ids[pos])
            state.num_computed_tokens += num_tokens
            out.request_ids.append(request_id)
            if state.num_computed_tokens < len(state.token_ids):
                out.sampled_token_ids.append([])
                out.logprobs.append(None)
                continue
            context = []
            for pos in range(state.num_computed_tokens):
                stored_pos, token = self.kv[self._slot(state, pos)]
                assert stored_pos == pos, f"{request_id}: slot of position {pos} holds {stored_pos}"
                context.append(token)
            if request_id in self.want_prompt_logprobs and start == 0:
                out.prompt_logprobs[request_id] = [None] * len(state.token_ids)
            token = next_token(context)
            state.token_ids.append(token)
            out.sampled_token_ids.append([token])
            out.logprobs.append(TokenLogprobs([token], [-0.5], 1))
        return out

    def _slot(self, state: _RunnerRequest, pos: int) -> int:
        return state.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size


def make_scheduler(
    cls: type[ContinuousBatchingScheduler] = FcfsScheduler,
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    max_model_len: int | None = None,
) -> ContinuousBatchingScheduler:
    config = EngineConfig(
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        enable_prefix_caching=enable_prefix_caching,
        max_model_len=max_model_len,
    )
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    return cls(config, kv)


def make_request(
    request_id: str, prompt: list[int], max_tokens: int | None = 4, priority: int = 0, **params
) -> Request:
    return Request(
        request_id, prompt, SamplingParams(max_tokens=max_tokens, **params), priority=priority
    )


def expected_tokens(request: Request, max_len: int) -> list[int]:
    """The stream the fake model produces without any scheduling in the way."""
    ref = Request("ref", request.prompt_token_ids, request.sampling_params)
    ref.eos_token_ids = request.eos_token_ids
    while True:
        ref.output_token_ids.append(next_token(ref.all_token_ids))
        if check_stop(ref, max_len):
            return ref.output_token_ids


def check_invariants(sched: ContinuousBatchingScheduler, so: SchedulerOutput | None) -> None:
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    owners: Counter[int] = Counter()
    for request in sched.running:
        blocks = kv.get_block_ids(request.request_id)
        assert len(blocks) == len(set(blocks))
        assert len(blocks) * kv.block_size >= request.num_computed_tokens
        owners.update(blocks)
    for request in sched.waiting:
        assert kv.get_block_ids(request.request_id) == []
        assert request.num_computed_tokens == 0
    for block in range(kv.num_blocks):
        assert pool.ref_count(block) == owners[block], f"block {block}"
        if owners[block] > 1:  # shared only through the prefix cache
            assert pool.block_hash(block) is not None
    assert pool.num_free_blocks + len(owners) == kv.num_blocks
    assert len(sched.running) <= sched.config.max_num_seqs
    if so is not None:
        assert so.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= sched.config.max_num_seqs
        assert all(n > 0 for n in so.num_scheduled_tokens.values())


@dataclass
class RunResult:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, EngineCoreOutput] = field(default_factory=dict)
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    steps: list[SchedulerOutput] = field(default_factory=list)


def run(
    sched: ContinuousBatchingScheduler,
    runner: FakeRunner,
    result: RunResult | None = None,
    max_steps: int = 1000,
) -> RunResult:
    """Step until nothing is unfinished, checking invariants after every step."""
    result = result or RunResult()
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        step(sched, runner, result)
    else:
        raise AssertionError("requests did not finish")
    check_invariants(sched, None)
    return result


def step(sched: ContinuousBatchingScheduler, runner: FakeRunner, result: RunResult) -> None:
    so = sched.schedule()
    check_invariants(sched, so)
    result.steps.append(so)
    collect(sched, so, runner.execute(so), result)
    check_invariants(sched, None)


# ---------------------------------------------------------------------------------------------
# Budget, chunked prefill, mixed batches
# ---------------------------------------------------------------------------------------------


def test_token_budget_and_max_num_seqs_are_respected() -> None:
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=10, block_size=4)
    runner = FakeRunner(4)
    requests = [make_request(f"r{i}", [i + 1] * (3 + i), max_tokens=5) for i in range(7)]
    for request in requests:
        sched.add_request(request)
    result = run(sched, runner)  # check_invariants asserts both limits every step
    assert max(len(s.num_scheduled_tokens) for s in result.steps) == 3
    assert max(s.total_num_scheduled_tokens for s in result.steps) == 10
    for request in requests:
        assert result.tokens[request.request_id] == expected_tokens(request, sched.max_len)
        assert result.finish[request.request_id].finish_reason == FinishReason.LENGTH


def test_chunked_prefill_splits_a_long_prompt() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, block_size=4)
    runner = FakeRunner(4)
    request = make_request("long", list(range(1, 51)), max_tokens=2)
    sched.add_request(request)
    result = RunResult()
    chunks = []
    for _ in range(4):
        step(sched, runner, result)
        chunks.append(result.steps[-1].num_scheduled_tokens["long"])
        # No token until the last chunk ends the prompt.
        assert ("long" in result.tokens) == (len(chunks) == 4)
    assert chunks == [16, 16, 16, 2]
    first, *rest = result.steps
    assert [r.request_id for r in first.new_requests] == ["long"]
    assert [c.num_computed_tokens for s in rest for c in s.cached_requests] == [16, 32, 48]
    run(sched, runner, result)
    assert result.tokens["long"] == expected_tokens(request, sched.max_len)


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits() -> None:
    sched = make_scheduler(max_num_batched_tokens=32, enable_chunked_prefill=False)
    runner = FakeRunner(4)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=3))
    result = RunResult()
    step(sched, runner, result)
    sched.add_request(make_request("b", list(range(32)), max_tokens=1))
    step(sched, runner, result)
    # a decodes (1 token): 31 left, b's 32-token prompt must wait whole.
    assert result.steps[-1].num_scheduled_tokens == {"a": 1}
    run(sched, runner, result)
    b_steps = [s.num_scheduled_tokens["b"] for s in result.steps if "b" in s.num_scheduled_tokens]
    assert b_steps == [32]


def test_decodes_and_a_prefill_share_a_step() -> None:
    sched = make_scheduler(max_num_batched_tokens=20)
    runner = FakeRunner(4)
    sched.add_request(make_request("a", [5, 6, 7], max_tokens=8))
    result = RunResult()
    step(sched, runner, result)
    sched.add_request(make_request("b", list(range(10)), max_tokens=2))
    step(sched, runner, result)
    so = result.steps[-1]
    assert so.num_scheduled_tokens == {"a": 1, "b": 10}
    assert [c.request_id for c in so.cached_requests] == ["a"]
    assert [n.request_id for n in so.new_requests] == ["b"]
    assert result.outputs[-2].request_id == "a" and result.outputs[-1].request_id == "b"


# ---------------------------------------------------------------------------------------------
# Preemption
# ---------------------------------------------------------------------------------------------


def workload(seed: int, n: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        make_request(
            f"r{i}",
            [rng.randrange(VOCAB) for _ in range(rng.randint(1, 10))],
            max_tokens=rng.randint(1, 12),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("cls", [FcfsScheduler, PriorityScheduler])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_under_a_tiny_cache_keeps_every_token_stream(
    cls: type[ContinuousBatchingScheduler], prefix_caching: bool
) -> None:
    tiny = make_scheduler(cls, num_blocks=8, block_size=4, enable_prefix_caching=prefix_caching)
    roomy = make_scheduler(cls, num_blocks=256, block_size=4)
    tiny_result, roomy_result = RunResult(), RunResult()
    for sched, result in ((tiny, tiny_result), (roomy, roomy_result)):
        for request in workload(seed=1, n=8):
            sched.add_request(request)
        run(sched, FakeRunner(4), result)
    assert tiny.num_preemptions > 0
    assert roomy.num_preemptions == 0
    assert tiny_result.tokens == roomy_result.tokens
    for request in workload(seed=1, n=8):
        assert tiny_result.tokens[request.request_id] == expected_tokens(request, 32)
    assert tiny.kv_cache_manager.num_free_blocks == 8
    assert tiny.stats().num_preemptions == tiny.num_preemptions


def test_preempted_request_is_dropped_then_resent_with_its_outputs() -> None:
    # 4 blocks of 2 tokens: two requests fit while short, then the later one is preempted.
    sched = make_scheduler(num_blocks=4, block_size=2)
    runner = FakeRunner(2)
    a = make_request("a", [1, 2, 3], max_tokens=4)
    b = make_request("b", [4, 5, 6], max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    result = RunResult()
    while sched.num_preemptions == 0:
        step(sched, runner, result)
    preempting = result.steps[-1]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert "b" in preempting.finished_request_ids and "b" not in preempting.num_scheduled_tokens
    assert sched.waiting == [b]
    outputs_so_far = list(b.output_token_ids)
    assert outputs_so_far
    run(sched, runner, result)
    resent = next(
        n
        for s in result.steps
        for n in s.new_requests
        if n.request_id == "b" and n.output_token_ids
    )
    assert resent.output_token_ids == outputs_so_far
    assert result.tokens["a"] == expected_tokens(a, sched.max_len)
    assert result.tokens["b"] == expected_tokens(b, sched.max_len)


def test_fcfs_preempts_the_latest_arrival_and_keeps_arrival_order() -> None:
    sched = make_scheduler(num_blocks=6, block_size=2)
    runner = FakeRunner(2)
    requests = [make_request(n, [1, 2], max_tokens=6) for n in ("a", "b", "c")]
    for request in requests:
        sched.add_request(request)
    result = RunResult()
    while sched.num_preemptions == 0:
        step(sched, runner, result)
    assert [r.request_id for r in sched.waiting] == ["c"]
    preempted_at = len(result.steps)
    late = make_request("d", [3, 4], max_tokens=1)
    sched.add_request(late)
    assert [r.request_id for r in sched.waiting] == ["c", "d"]
    run(sched, runner, result)
    admitted = [n.request_id for s in result.steps[preempted_at:] for n in s.new_requests]
    assert admitted.index("c") < admitted.index("d")  # c keeps its place ahead of d
    for request in [*requests, late]:
        assert result.tokens[request.request_id] == expected_tokens(request, sched.max_len)


# ---------------------------------------------------------------------------------------------
# Prefix cache
# ---------------------------------------------------------------------------------------------


def test_common_prefix_shares_blocks_and_counts_hits() -> None:
    sched = make_scheduler(block_size=4)
    runner = FakeRunner(4)
    prefix = list(range(100, 108))  # two full blocks
    a = make_request("a", [*prefix, 1, 2], max_tokens=6)
    b = make_request("b", [*prefix, 3], max_tokens=3)
    sched.add_request(a)
    result = RunResult()
    step(sched, runner, result)  # a's prefill
    step(sched, runner, result)  # a's first decode registers its full blocks
    sched.add_request(b)
    step(sched, runner, result)
    kv = sched.kv_cache_manager
    (new_b,) = result.steps[-1].new_requests
    assert new_b.num_computed_tokens == 8
    assert result.steps[-1].num_scheduled_tokens["b"] == 1
    shared = kv.get_block_ids("a")[:2]
    assert kv.get_block_ids("b")[:2] == shared == new_b.block_ids[0][:2]
    assert [kv.block_pool.ref_count(x) for x in shared] == [2, 2]
    assert b.num_cached_tokens == 8
    stats = sched.stats()
    assert stats.prefix_cache_hits == 8
    assert stats.prefix_cache_queries == a.num_prompt_tokens + b.num_prompt_tokens
    run(sched, runner, result)
    assert result.finish["b"].num_cached_tokens == 8
    assert result.tokens["b"] == expected_tokens(b, sched.max_len)
    assert result.tokens["a"] == expected_tokens(a, sched.max_len)
    assert kv.num_free_blocks == kv.num_blocks


def test_identical_prompt_after_finish_recomputes_only_the_last_block() -> None:
    sched = make_scheduler(block_size=4)
    runner = FakeRunner(4)
    prompt = list(range(12))
    sched.add_request(make_request("a", prompt, max_tokens=1))
    result = run(sched, runner)
    sched.add_request(make_request("b", prompt, max_tokens=1))
    run(sched, runner, result)
    assert result.steps[-1].num_scheduled_tokens == {"b": 4}
    assert result.tokens["a"] == result.tokens["b"]


# ---------------------------------------------------------------------------------------------
# Abort, completion, validation
# ---------------------------------------------------------------------------------------------


def test_abort_frees_blocks_and_reports_to_the_runner() -> None:
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(4)
    sched.add_request(make_request("run", list(range(9)), max_tokens=10))
    sched.add_request(make_request("wait", [1, 2], max_tokens=10))
    result = RunResult()
    step(sched, runner, result)
    assert sched.kv_cache_manager.usage > 0
    sched.abort(["run", "wait", "unknown"])
    sched.abort(["run"])  # already finished: ignored
    assert not sched.has_unfinished()
    assert sched.has_finished_requests()
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks
    so = sched.schedule()
    assert so.finished_request_ids == {"run"}  # the runner never saw "wait"
    assert so.is_empty
    runner.execute(so)
    assert runner.batch == {}


def test_every_block_is_free_after_all_requests_finish() -> None:
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=8)
    requests = workload(seed=3, n=12)
    for request in requests:
        sched.add_request(request)
    result = run(sched, FakeRunner(4))
    assert set(result.finish) == {r.request_id for r in requests}
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and kv.usage == 0.0
    assert sched.stats().num_running == sched.stats().num_waiting == 0


def test_outputs_carry_logprobs_and_prompt_logprobs() -> None:
    sched = make_scheduler()
    runner = FakeRunner(4, want_prompt_logprobs={"a"})
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=2))
    result = run(sched, runner)
    first, second = result.outputs
    assert first.prompt_logprobs == [None, None, None]
    assert first.new_logprobs == [TokenLogprobs(first.new_token_ids, [-0.5], 1)]
    assert second.prompt_logprobs is None
    assert second.finish_reason == FinishReason.LENGTH


def test_runner_sampling_mid_prefill_is_rejected() -> None:
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add_request(make_request("a", list(range(10))))
    so = sched.schedule()
    with pytest.raises(ValueError, match="samples nothing"):
        sched.update_from_output(so, ModelRunnerOutput(["a"], [[5]]))


def test_validation_errors() -> None:
    with pytest.raises(ValueError, match="does not fit in the KV cache"):
        make_scheduler(num_blocks=4, block_size=4, max_model_len=17)
    config = EngineConfig(block_size=8)
    with pytest.raises(ValueError, match="block size"):
        FcfsScheduler(config, KVCacheManager(4, 4))
    sched = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="more than the 16"):
        sched.add_request(make_request("big", list(range(17))))
    sched.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a", [1]))


def test_request_filling_the_whole_cache_finishes_with_length() -> None:
    sched = make_scheduler(num_blocks=2, block_size=4)  # max_model_len unset: 8 tokens
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=None))
    result = run(sched, FakeRunner(4))
    assert len(result.tokens["a"]) == 5
    assert result.finish["a"].finish_reason == FinishReason.LENGTH


def test_builtin_schedulers_are_registered() -> None:
    registry: Registry[object] = Registry("scheduler")
    chassis_register_schedulers(registry)
    assert registry.get("fcfs") is FcfsScheduler
    assert registry.get("priority") is PriorityScheduler


# ---------------------------------------------------------------------------------------------
# Stop conditions
# ---------------------------------------------------------------------------------------------


def stop_after(outputs: list[int], max_model_len: int | None = None, **params) -> Request:
    request = Request("s", [1, 2], SamplingParams(**params), eos_token_ids=[0])
    for token in outputs:
        request.output_token_ids.append(token)
        if check_stop(request, max_model_len):
            break
    return request


def test_stop_on_eos_unless_ignored() -> None:
    request = stop_after([5, 0, 6], max_tokens=10)
    assert request.output_token_ids == [5, 0]
    assert request.finish_reason == FinishReason.STOP and request.stop_reason is None
    ignored = stop_after([5, 0, 6], max_tokens=10, ignore_eos=True)
    assert ignored.output_token_ids == [5, 0, 6] and ignored.finish_reason is None


def test_stop_token_ids_set_stop_reason() -> None:
    request = stop_after([5, 9, 6], max_tokens=10, stop_token_ids=[9])
    assert request.output_token_ids == [5, 9]
    assert request.finish_reason == FinishReason.STOP and request.stop_reason == 9


def test_min_tokens_defers_eos_and_stop_tokens() -> None:
    request = stop_after([0, 9, 0, 4], max_tokens=10, min_tokens=3, stop_token_ids=[9])
    assert request.output_token_ids == [0, 9, 0]
    assert request.finish_reason == FinishReason.STOP


def test_max_tokens_and_max_model_len_give_length() -> None:
    request = stop_after([5, 6, 7, 8], max_tokens=3)
    assert request.output_token_ids == [5, 6, 7]
    assert request.finish_reason == FinishReason.LENGTH
    capped = stop_after([5, 6, 7, 8], max_model_len=4, max_tokens=None)
    assert capped.output_token_ids == [5, 6]  # 2 prompt + 2 outputs = 4 tokens
    assert capped.finish_reason == FinishReason.LENGTH


def test_stop_token_at_the_length_limit_reports_stop() -> None:
    request = stop_after([5, 9], max_tokens=2, stop_token_ids=[9])
    assert request.finish_reason == FinishReason.STOP and request.stop_reason == 9


def test_scheduler_applies_eos_through_update() -> None:
    prompt = [1, 2, 3]
    eos = next_token(prompt)  # the very first sampled token
    sched = make_scheduler()
    request = Request("a", prompt, SamplingParams(max_tokens=5), eos_token_ids=[eos])
    sched.add_request(request)
    result = run(sched, FakeRunner(4))
    assert result.steps[0].new_requests[0].eos_token_ids == frozenset([eos])  # for min_tokens
    assert result.tokens["a"] == [eos]
    assert result.finish["a"].finish_reason == FinishReason.STOP


# ---------------------------------------------------------------------------------------------
# Priority
# ---------------------------------------------------------------------------------------------


def test_priority_orders_waiting_requests() -> None:
    sched = make_scheduler(PriorityScheduler, max_num_seqs=1)
    for request_id, priority in (("low", 5), ("high", -1), ("mid", 0), ("mid2", 0)):
        sched.add_request(make_request(request_id, [1, 2], max_tokens=2, priority=priority))
    assert [r.request_id for r in sched.waiting] == ["high", "mid", "mid2", "low"]
    result = run(sched, FakeRunner(4))
    order = [n.request_id for s in result.steps for n in s.new_requests]
    assert order == ["high", "mid", "mid2", "low"]


def test_high_priority_arrival_preempts_low_priority_running() -> None:
    sched = make_scheduler(PriorityScheduler, num_blocks=4, block_size=4)
    runner = FakeRunner(4)
    low = make_request("low", list(range(12)), max_tokens=3, priority=10)
    sched.add_request(low)
    result = RunResult()
    step(sched, runner, result)  # low holds 3 of 4 blocks
    urgent = make_request("urgent", list(range(50, 58)), max_tokens=2, priority=0)
    sched.add_request(urgent)
    step(sched, runner, result)
    so = result.steps[-1]
    assert [n.request_id for n in so.new_requests] == ["urgent"]
    assert "low" in so.finished_request_ids and "low" not in so.num_scheduled_tokens
    assert low.status == RequestStatus.PREEMPTED and sched.num_preemptions == 1
    run(sched, runner, result)
    assert result.tokens["low"] == expected_tokens(low, sched.max_len)
    assert result.tokens["urgent"] == expected_tokens(urgent, sched.max_len)
    assert list(result.finish) == ["urgent", "low"]


def test_fcfs_arrival_does_not_preempt() -> None:
    sched = make_scheduler(FcfsScheduler, num_blocks=4, block_size=4)
    runner = FakeRunner(4)
    sched.add_request(make_request("first", list(range(12)), max_tokens=3, priority=10))
    result = RunResult()
    step(sched, runner, result)
    sched.add_request(make_request("second", list(range(50, 58)), max_tokens=2, priority=0))
    step(sched, runner, result)
    assert result.steps[-1].num_scheduled_tokens == {"first": 1}
    run(sched, runner, result)
    assert sched.num_preemptions == 0
    assert list(result.finish) == ["first", "second"]


def test_priority_running_victim_is_the_worst_key() -> None:
    sched = make_scheduler(PriorityScheduler, num_blocks=6, block_size=2)
    runner = FakeRunner(2)
    for request_id, priority in (("p1", 1), ("p9", 9), ("p5", 5)):
        sched.add_request(make_request(request_id, [1, 2], max_tokens=8, priority=priority))
    result = RunResult()
    while sched.num_preemptions == 0:
        step(sched, runner, result)
    assert [r.request_id for r in sched.waiting] == ["p9"]
    run(sched, runner, result)


# ---------------------------------------------------------------------------------------------
# Random workloads
# ---------------------------------------------------------------------------------------------


@dataclass
class AsyncStepper:
    """Steps as the engine core does under async scheduling: plan and execute step N+1, then
    hand step N's results to the scheduler. The fake runner knows its sampled tokens at once
    (as the device does), the scheduler only one step later."""

    in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
    #: decodes planned while the token they decode was still unknown to the scheduler
    num_unknown_token_decodes: int = 0

    def __call__(
        self, sched: ContinuousBatchingScheduler, runner: FakeRunner, result: RunResult
    ) -> None:
        so = sched.schedule()
        check_invariants(sched, so)
        result.steps.append(so)
        self.num_unknown_token_decodes += sum(
            sched.requests[r.request_id].num_output_placeholders == 2 for r in so.cached_requests
        )
        runner_output = runner.execute(so)
        if self.in_flight is not None:
            collect(sched, *self.in_flight, result)
        self.in_flight = None if so.is_empty else (so, runner_output)
        check_invariants(sched, None)


def collect(
    sched: ContinuousBatchingScheduler,
    so: SchedulerOutput,
    runner_output: ModelRunnerOutput,
    result: RunResult,
) -> None:
    for out in sched.update_from_output(so, runner_output):
        result.outputs.append(out)
        result.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            result.finish[out.request_id] = out


# ---------------------------------------------------------------------------------------------
# Async scheduling: plans made before the previous step's tokens are known
# ---------------------------------------------------------------------------------------------


def test_async_plan_decodes_the_token_in_flight() -> None:
    sched = make_scheduler()
    runner = FakeRunner(4)
    request = make_request("a", [1, 2, 3], max_tokens=5)
    sched.add_request(request)
    prefill = sched.schedule()
    assert prefill.num_scheduled_tokens == {"a": 3}
    assert request.num_output_placeholders == 1  # the prefill samples the first token
    prefill_output = runner.execute(prefill)

    decode = sched.schedule()  # before the first token is known
    assert decode.num_scheduled_tokens == {"a": 1}
    assert decode.cached_requests[0].num_computed_tokens == 3  # position of the unknown token
    assert request.num_output_placeholders == 2 and request.output_token_ids == []
    decode_output = runner.execute(decode)

    result = RunResult()
    collect(sched, prefill, prefill_output, result)
    assert request.num_output_placeholders == 1 and len(request.output_token_ids) == 1
    collect(sched, decode, decode_output, result)
    assert request.num_output_placeholders == 0
    assert result.tokens["a"] == expected_tokens(request, sched.max_len)[:2]


def test_async_plan_skips_a_request_its_tokens_in_flight_finish() -> None:
    sched = make_scheduler(max_model_len=16)
    runner = FakeRunner(4)
    short = make_request("short", [1, 2, 3], max_tokens=1)
    long_prompt = make_request("long", list(range(15)), max_tokens=None)  # ends at 16 tokens
    sched.add_request(short)
    sched.add_request(long_prompt)
    first = sched.schedule()
    first_output = runner.execute(first)
    # Each request's one sampled token finishes it (max_tokens 1; max_model_len 16).
    assert sched.schedule().is_empty
    result = RunResult()
    collect(sched, first, first_output, result)
    assert result.finish["short"].finish_reason == FinishReason.LENGTH
    assert result.finish["long"].finish_reason == FinishReason.LENGTH
    assert not sched.has_unfinished()


def test_async_preemption_drops_the_token_in_flight_and_resamples_it() -> None:
    # 3 blocks of 2 tokens: "b" is preempted once "a" needs a third block.
    sched = make_scheduler(num_blocks=3, block_size=2)
    runner = FakeRunner(2)
    a = make_request("a", [1, 2, 3], max_tokens=3)
    b = make_request("b", [4], max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    stepper = AsyncStepper()
    result = RunResult()
    while sched.num_preemptions == 0:
        stepper(sched, runner, result)
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 0
    # The plan before the preempting one decoded "b"'s first token and sampled its second,
    # which was still in flight at the preemption: dropped (the resumed request resamples it).
    assert result.steps[-2].num_scheduled_tokens.get("b") == 1
    assert len(b.output_token_ids) == 1 and result.tokens["b"] == b.output_token_ids
    while sched.has_unfinished() or stepper.in_flight is not None:
        stepper(sched, runner, result)
    assert result.tokens["a"] == expected_tokens(a, sched.max_len)
    assert result.tokens["b"] == expected_tokens(b, sched.max_len)
    assert sched.kv_cache_manager.num_free_blocks == 3


def run_random_workload(
    seed: int, async_scheduling: bool = False
) -> tuple[ContinuousBatchingScheduler, int]:
    """A random workload (arrivals, shared prefixes, aborts) under random limits; checks the
    invariants every step and every token stream at the end. ``async_scheduling``: plan each
    step before the previous one's results are in (:class:`AsyncStepper`). Returns the
    scheduler and how many decodes of still unknown tokens were planned."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    num_blocks = rng.randint(4, 16)
    budget = rng.randint(8, 24)
    chunked = rng.random() < 0.7
    max_model_len = min(num_blocks * block_size, 10_000 if chunked else budget)
    sched = make_scheduler(
        rng.choice([FcfsScheduler, PriorityScheduler]),
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=rng.randint(1, 5),
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=rng.random() < 0.7,
        max_model_len=max_model_len,
    )
    runner = FakeRunner(block_size)
    shared = [rng.randrange(VOCAB) for _ in range(8)]
    requests: list[Request] = []
    for i in range(rng.randint(1, 12)):
        head = shared if rng.random() < 0.5 else [rng.randrange(VOCAB) for _ in range(8)]
        tail_len = rng.randint(1, min(12, max_model_len - 1))
        prompt = head[: rng.randint(0, 8)] + [rng.randrange(VOCAB) for _ in range(tail_len)]
        requests.append(
            make_request(
                f"r{i}",
                prompt[:max_model_len],
                max_tokens=rng.randint(1, 16),
                priority=rng.randint(0, 3),
            )
        )
    pending = list(requests)
    aborted: set[str] = set()
    result = RunResult()
    stepper = AsyncStepper() if async_scheduling else step
    for _ in range(2000):
        while pending and rng.random() < 0.6:
            sched.add_request(pending.pop(0))
        if sched.requests and rng.random() < 0.03:
            victim = rng.choice(sorted(sched.requests))
            sched.abort([victim])
            aborted.add(victim)
        in_flight = isinstance(stepper, AsyncStepper) and stepper.in_flight is not None
        if not pending and not sched.has_unfinished() and not in_flight:
            break
        stepper(sched, runner, result)
    else:
        raise AssertionError("workload did not finish")
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    for request in requests:
        rid = request.request_id
        expected = expected_tokens(request, sched.max_len)
        if rid in aborted:
            assert rid not in result.finish
            assert expected[: len(result.tokens.get(rid, []))] == result.tokens.get(rid, [])
        else:
            assert result.tokens[rid] == expected
            assert result.finish[rid].finish_reason == FinishReason.LENGTH
    unknown = stepper.num_unknown_token_decodes if isinstance(stepper, AsyncStepper) else 0
    return sched, unknown


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_random_workloads_keep_invariants_and_token_streams(async_scheduling: bool) -> None:
    num_preempted = num_hit = num_unknown_token_decodes = 0
    for seed in range(300):
        try:
            sched, unknown = run_random_workload(seed, async_scheduling)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}: {exc}") from exc
        num_preempted += sched.num_preemptions > 0
        num_hit += sched.kv_cache_manager.prefix_cache_hits > 0
        num_unknown_token_decodes += unknown
    # The workloads do exercise preemption and prefix-cache hits.
    assert num_preempted > 50 and num_hit > 50
    if async_scheduling:
        assert num_unknown_token_decodes > 1000
