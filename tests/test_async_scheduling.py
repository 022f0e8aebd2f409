"""Async scheduling through the real engine (tiny Llama, CPU): the same results as without it.

Under ``async_scheduling`` the engine core launches plan N+1 before it collects plan N, the
runner reads the tokens it decodes from the previous step's device tensor, and outputs reach
the caller one step later. Everything a request produces must be identical to a synchronous
run: greedy and seeded tokens, stops, logprobs, with chunked prefills, preemptions, penalties
(which wait for the tokens in flight) and aborts.
"""

from __future__ import annotations

import pytest

from chassis import LLM, SamplingParams
from chassis.builtin_plugins.schedulers.fcfs import FcfsScheduler

MAX_MODEL_LEN = 128
BLOCK_SIZE = 4
#: one full-length request's worth of blocks: the workload below must preempt
TINY_NUM_BLOCKS = MAX_MODEL_LEN // BLOCK_SIZE

PROMPTS = [
    "Once upon a time in a land far away there lived a dragon who loved bread",
    "The quick brown fox jumps over the lazy dog again and again and again",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)",
    "A long, winding road leads through the mountains to a small village by the sea",
    "Hello, world!",
    "The capital of France is Paris, and the capital of Italy is",
    "Roses are red, violets are blue, sugar is sweet, and so are",
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test of this module runs on one intra-op thread (``fixtures_threads``)."""


def make_llm(model_dir, async_scheduling: bool, **engine) -> LLM:
    settings = {
        "dtype": "float32",
        "max_model_len": MAX_MODEL_LEN,
        "block_size": BLOCK_SIZE,
        "num_kv_blocks": 256,
        "async_scheduling": async_scheduling,
    }
    settings.update(engine)
    return LLM(str(model_dir), **settings)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    """``engines(**settings)``: a (sync, async) pair of engines with those settings, cached."""
    built: dict[tuple, tuple[LLM, LLM]] = {}

    def get(**settings) -> tuple[LLM, LLM]:
        key = tuple(sorted(settings.items()))
        if key not in built:
            built[key] = (
                make_llm(tiny_llama_dir, False, **settings),
                make_llm(tiny_llama_dir, True, **settings),
            )
        return built[key]

    return get


def summary(outputs) -> list[tuple]:
    return [
        (
            o.outputs[0].token_ids,
            o.outputs[0].finish_reason,
            o.outputs[0].stop_reason,
            o.outputs[0].text,
        )
        for o in outputs
    ]


def assert_logprobs_close(got, expected) -> None:
    """Same tokens and ranks; values within float32 noise (async steps batch the rows
    differently: a request that stopped still rides along one step, which changes the matmul
    shapes and hence the rounding of the logits)."""
    assert (got is None) == (expected is None)
    for g, e in zip(got or [], expected or [], strict=True):
        assert (g is None) == (e is None)
        if g is None:
            continue
        assert list(g) == list(e)
        for token_id, lp in g.items():
            assert lp.rank == e[token_id].rank
            assert lp.decoded_token == e[token_id].decoded_token
            assert lp.logprob == pytest.approx(e[token_id].logprob, abs=1e-4)


def assert_idle_and_free(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished()
    assert engine.kv_cache_manager.num_free_blocks == engine.info.num_kv_blocks
    assert engine.executor.worker.runner.in_flight.num_unresolved_steps == 0


def test_greedy_with_chunked_prefill_and_preemption_equals_sync(engines):
    sync, async_ = engines(num_kv_blocks=TINY_NUM_BLOCKS, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = summary(sync.generate(PROMPTS, params))
    before = async_.engine.scheduler.num_preemptions
    got = summary(async_.generate(PROMPTS, params))
    assert async_.engine.scheduler.num_preemptions > before
    assert got == expected
    assert_idle_and_free(async_)


def test_stops_and_limits_equal_sync(engines):
    sync, async_ = engines()
    free_run = sync.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    # Stop on a token each request generates partway through (even rows: before max_tokens;
    # odd rows: after it, so most of them end by length).
    params = []
    for i, output in enumerate(free_run):
        ids = output.outputs[0].token_ids
        stop_at, max_tokens = (2 + i, 12) if i % 2 == 0 else (14, 3 + i)
        params.append(
            SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                stop_token_ids=[ids[min(len(ids) - 1, stop_at)]],
                min_tokens=2 if i % 3 == 0 else 0,
            )
        )
    expected = summary(sync.generate(PROMPTS, params))
    assert {e[1] for e in expected} == {"stop", "length"}
    assert summary(async_.generate(PROMPTS, params)) == expected
    assert_idle_and_free(async_)


def test_seeded_sampling_penalties_and_logprobs_equal_sync(engines):
    sync, async_ = engines(num_kv_blocks=TINY_NUM_BLOCKS, max_num_batched_tokens=16)
    params = [
        SamplingParams(
            temperature=0.8,
            top_p=0.9 if i % 2 else 1.0,
            seed=1000 + i,
            max_tokens=30,
            ignore_eos=True,
            # Penalties and min_tokens read the generated tokens: those steps wait for the
            # tokens in flight instead of overlapping.
            repetition_penalty=1.3 if i % 4 == 1 else 1.0,
            frequency_penalty=0.5 if i % 4 == 2 else 0.0,
            min_tokens=5 if i % 4 == 3 else 0,
            logprobs=3 if i % 2 == 0 else None,
            prompt_logprobs=2 if i == 4 else None,
        )
        for i in range(len(PROMPTS))
    ]
    expected = sync.generate(PROMPTS, params)
    got = async_.generate(PROMPTS, params)
    assert summary(got) == summary(expected)
    for e, g in zip(expected, got, strict=True):
        assert_logprobs_close(g.outputs[0].logprobs, e.outputs[0].logprobs)
        assert_logprobs_close(g.prompt_logprobs, e.prompt_logprobs)
    assert got[0].outputs[0].logprobs and got[4].prompt_logprobs
    assert_idle_and_free(async_)


def test_steps_overlap_and_decode_tokens_come_from_the_device(engines, monkeypatch):
    _, async_ = engines()
    engine = async_.engine
    scheduler = engine.scheduler
    in_flight = engine.executor.worker.runner.in_flight
    events: list[tuple[str, int]] = []
    plans: list[object] = []  # kept alive, so that identities stay unique
    device_reads = 0
    schedule, update, input_ids = (
        scheduler.schedule,
        scheduler.update_from_output,
        in_flight.input_ids,
    )

    def spy_schedule():
        out = schedule()
        plans.append(out)
        events.append(("schedule", len(plans) - 1))
        return out

    def spy_update(out, runner_output):
        events.append(("update", next(i for i, p in enumerate(plans) if p is out)))
        return update(out, runner_output)

    def spy_input_ids(*args):
        nonlocal device_reads
        device_reads += 1
        return input_ids(*args)

    monkeypatch.setattr(scheduler, "schedule", spy_schedule)
    monkeypatch.setattr(scheduler, "update_from_output", spy_update)
    monkeypatch.setattr(in_flight, "input_ids", spy_input_ids)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    async_.generate(PROMPTS[:3], params)

    updates = [plan for kind, plan in events if kind == "update"]
    assert updates == sorted(updates)  # collected in plan order
    for plan in updates:
        # Plan N is collected only after plan N+1 was made (and launched).
        assert events.index(("schedule", plan + 1)) < events.index(("update", plan))
    # Every decode step after the first reads the previous step's samples on the device.
    assert device_reads >= 12 - 2
    assert_idle_and_free(async_)


def test_abort_while_a_step_is_in_flight(engines):
    _, async_ = engines()
    engine = async_.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for request_id, prompt in (("victim", PROMPTS[0]), ("other", PROMPTS[1])):
        engine.add_request(async_.input_processor.process(prompt, params, request_id)[0])
    produced: dict[str, list[int]] = {"victim": [], "other": []}
    for _ in range(4):
        for out in engine.step().outputs:
            produced[out.request_id].extend(out.new_token_ids)
    assert engine.has_unfinished() and engine._in_flight is not None
    num_victim = len(produced["victim"])
    assert num_victim >= 2
    engine.abort_requests(["victim"])
    while engine.has_unfinished():
        for out in engine.step().outputs:
            produced[out.request_id].extend(out.new_token_ids)
    assert len(produced["victim"]) == num_victim  # nothing after the abort, not even in flight
    assert len(produced["other"]) == 30
    assert "victim" not in engine.executor.worker.runner.batch.row_of
    assert_idle_and_free(async_)


@pytest.mark.parametrize("budget", [2048, 8], ids=["whole-prompt", "chunked"])
def test_an_id_reused_while_its_old_request_is_in_flight(engines, budget):
    """Abort a request and add a new one under the same id before the step that still holds
    the old one is collected: the old request's token must not reach the new one."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = engines()[0].generate([PROMPTS[1]], params)[0].outputs[0].token_ids
    _, async_ = engines(max_num_batched_tokens=budget)
    engine = async_.engine
    engine.add_request(async_.input_processor.process(PROMPTS[0], params, "A")[0])
    for _ in range(3):
        engine.step()
    assert engine._in_flight is not None
    engine.abort_requests(["A"])
    engine.add_request(async_.input_processor.process(PROMPTS[1], params, "A")[0])
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step().outputs for t in out.new_token_ids]
    assert tokens == expected
    assert_idle_and_free(async_)


def test_a_scheduler_without_async_support_is_refused(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(FcfsScheduler, "supports_async_scheduling", False)
    with pytest.raises(ValueError, match="does not support --async-scheduling"):
        make_llm(tiny_llama_dir, True)
