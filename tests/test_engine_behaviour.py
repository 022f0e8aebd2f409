"""Engine behaviour through the real ``LLM`` and ``EngineCore`` with the tiny Llama checkpoint.

Covers what the scheduler, KV cache manager and model runner do together: preemption under a
tiny KV cache (greedy and seeded outputs unchanged), every block free again afterwards,
prefix-cache hits that really reuse blocks, bad input that loses nothing, and aborts that free
blocks and silence the request. Sampling and logprobs live in ``test_engine_sampling.py``.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from chassis import LLM, SamplingParams
from chassis.core.request import EngineCoreOutput

MAX_MODEL_LEN = 128
BLOCK_SIZE = 4
#: exactly enough blocks for one request of max_model_len tokens
TINY_NUM_BLOCKS = MAX_MODEL_LEN // BLOCK_SIZE
BIG_NUM_BLOCKS = 256

#: prompts of 10-40 tokens; with 40 new tokens each needs 13-20 blocks, so only one or two
#: fit in the tiny cache at a time and the others must be preempted
PREEMPTION_PROMPTS = [
    "Once upon a time in a land far away there lived a dragon who loved bread",
    "The quick brown fox jumps over the lazy dog again and again and again",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)",
    "A long, winding road leads through the mountains to a small village by the sea, "
    "where the fishermen mend their nets",
    "Hello, world!",
    "The capital of France is Paris, and the capital of Italy is",
    "Roses are red, violets are blue, sugar is sweet, and so are",
]
PREEMPTION_MAX_TOKENS = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=PREEMPTION_MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test of this module runs on one intra-op thread (``fixtures_threads``)."""


def make_llm(model_dir, **engine) -> LLM:
    settings = {
        "dtype": "float32",
        "max_model_len": MAX_MODEL_LEN,
        "block_size": BLOCK_SIZE,
        "num_kv_blocks": BIG_NUM_BLOCKS,
    }
    settings.update(engine)
    return LLM(str(model_dir), **settings)


def assert_all_blocks_free(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished()
    assert engine.kv_cache_manager.num_free_blocks == engine.info.num_kv_blocks
    assert engine.kv_cache_manager.usage == 0.0


@pytest.fixture(scope="module")
def big_llm(tiny_llama_dir) -> LLM:
    """Plenty of KV blocks: the reference run, and the engine for the other tests."""
    return make_llm(tiny_llama_dir)


@pytest.fixture(scope="module")
def reference_greedy(big_llm) -> list[list[int]]:
    outputs = big_llm.generate(PREEMPTION_PROMPTS, GREEDY)
    assert big_llm.engine.scheduler.num_preemptions == 0
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    """``tiny_llm(scheduler, prefix_caching)``: an engine whose KV cache holds one full-length
    request, with chunked prefill (16-token budget); built once per setting."""
    built: dict[tuple[str, bool], LLM] = {}

    def get(scheduler: str, enable_prefix_caching: bool) -> LLM:
        key = (scheduler, enable_prefix_caching)
        if key not in built:
            built[key] = make_llm(
                tiny_llama_dir,
                num_kv_blocks=TINY_NUM_BLOCKS,
                max_num_batched_tokens=16,
                scheduler=scheduler,
                enable_prefix_caching=enable_prefix_caching,
            )
        return built[key]

    return get


# -- preemption and block accounting ---------------------------------------------------------


@pytest.mark.parametrize("enable_prefix_caching", [True, False], ids=["prefix-on", "prefix-off"])
@pytest.mark.parametrize("scheduler", ["fcfs", "priority"])
def test_preemption_keeps_greedy_outputs_and_frees_every_block(
    tiny_llm, reference_greedy, scheduler, enable_prefix_caching
):
    llm = tiny_llm(scheduler, enable_prefix_caching)
    before = llm.engine.scheduler.stats().num_preemptions
    # Priorities out of arrival order make the priority scheduler preempt for waiting requests.
    # (fcfs refuses non-zero priorities, as vLLM does)
    priority = [
        (7 * i) % 5 if scheduler == "priority" else 0 for i in range(len(PREEMPTION_PROMPTS))
    ]
    outputs = llm.generate(PREEMPTION_PROMPTS, GREEDY, priority=priority)

    assert llm.engine.scheduler.stats().num_preemptions > before
    assert [o.outputs[0].token_ids for o in outputs] == reference_greedy
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert_all_blocks_free(llm)


def test_preemption_keeps_seeded_samples(tiny_llm, big_llm):
    """A seeded request resumed after preemption continues its random stream where it was."""
    params = [
        SamplingParams(temperature=1.0, seed=100 + i, max_tokens=PREEMPTION_MAX_TOKENS)
        for i in range(len(PREEMPTION_PROMPTS))
    ]
    expected = [o.outputs[0].token_ids for o in big_llm.generate(PREEMPTION_PROMPTS, params)]
    llm = tiny_llm("fcfs", True)
    before = llm.engine.scheduler.stats().num_preemptions
    got = [o.outputs[0].token_ids for o in llm.generate(PREEMPTION_PROMPTS, params)]
    assert llm.engine.scheduler.stats().num_preemptions > before
    assert got == expected
    assert_all_blocks_free(llm)


def test_blocks_free_after_mixed_finish_reasons(big_llm):
    """Requests ending by length, stop token, stop string (front-end abort) and n > 1."""
    greedy = big_llm.generate(["Blocks come back"], SamplingParams(temperature=0, max_tokens=8))
    tokens, text = greedy[0].outputs[0].token_ids, greedy[0].outputs[0].text
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[tokens[3]]),
        SamplingParams(temperature=0.0, max_tokens=20, stop=[text[len(text) // 2 :][:3]]),
        SamplingParams(temperature=1.0, max_tokens=20, n=3, ignore_eos=True),
    ]
    outputs = big_llm.generate(["Blocks come back"] * len(params), params)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "stop", "stop", "length"]
    assert len(outputs[3].outputs) == 3
    assert_all_blocks_free(big_llm)


# -- prefix caching --------------------------------------------------------------------------


def test_prefix_cache_hits_are_counted_and_keep_outputs(big_llm):
    shared = "Prefix caching test: a shared system prompt long enough for several blocks. "
    prompts = [shared + "First question?", shared + "Second question?"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kv = big_llm.engine.kv_cache_manager
    hits_before = kv.prefix_cache_hits

    first = big_llm.generate(prompts[:1], params)[0]
    assert first.num_cached_tokens == 0
    second = big_llm.generate(prompts[1:], params)[0]
    assert second.num_cached_tokens > 0
    assert second.num_cached_tokens % BLOCK_SIZE == 0
    assert kv.prefix_cache_hits - hits_before >= second.num_cached_tokens
    assert big_llm.engine.scheduler.stats().prefix_cache_hits == kv.prefix_cache_hits

    # The whole prompt again: every full block but the one holding the last token hits, and
    # the tokens are those computed without the cache.
    again = big_llm.generate(prompts[:1], params)[0]
    num_prompt = len(again.prompt_token_ids)
    assert again.num_cached_tokens == (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_all_blocks_free(big_llm)


def run_to_completion(llm: LLM) -> dict[str, list[EngineCoreOutput]]:
    """Step the engine core until nothing is unfinished; the outputs per request id."""
    outputs: dict[str, list[EngineCoreOutput]] = defaultdict(list)
    for _ in range(1000):
        if not llm.engine.has_unfinished():
            break
        for out in llm.engine.step().outputs:
            outputs[out.request_id].append(out)
    assert not llm.engine.has_unfinished()
    return outputs


def test_prefix_cache_hit_reuses_the_same_blocks(big_llm):
    shared = "Block reuse check: these words fill a few blocks of four tokens each. "
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    kv = big_llm.engine.kv_cache_manager
    first = big_llm.input_processor.process(shared + "One", params, "reuse-a")[0]
    second = big_llm.input_processor.process(shared + "Two", params, "reuse-b")[0]

    big_llm.engine.add_request(first)
    big_llm.engine.step()
    first_blocks = kv.get_block_ids("reuse-a")
    run_to_completion(big_llm)

    big_llm.engine.add_request(second)
    out = big_llm.engine.step().outputs[0]
    second_blocks = kv.get_block_ids("reuse-b")
    num_hit_blocks = out.num_cached_tokens // BLOCK_SIZE
    assert num_hit_blocks >= 2
    assert second_blocks[:num_hit_blocks] == first_blocks[:num_hit_blocks]
    # The blocks after the shared prefix are new ones.
    assert not set(second_blocks[num_hit_blocks:]) & set(first_blocks[:num_hit_blocks])
    run_to_completion(big_llm)
    assert_all_blocks_free(big_llm)


# -- bad input and aborts --------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompts, params",
    [
        (["Hello", "word " * MAX_MODEL_LEN], SamplingParams(max_tokens=4)),
        (["Hello", "Hi"], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=MAX_MODEL_LEN)]),
        (["Hello", [10**6]], SamplingParams(max_tokens=4)),
    ],
    ids=["prompt-too-long", "completion-too-long", "token-out-of-vocab"],
)
def test_bad_request_in_a_batch_loses_nothing(big_llm, prompts, params):
    with pytest.raises(ValueError):
        big_llm.generate(prompts, params)
    # Nothing of the batch was queued, and the engine still works.
    assert_all_blocks_free(big_llm)
    out = big_llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    assert_all_blocks_free(big_llm)


def test_abort_frees_blocks_and_silences_the_request(big_llm):
    engine = big_llm.engine
    kv = engine.kv_cache_manager
    runner_batch = engine.executor.worker.runner.batch
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    victim = big_llm.input_processor.process("Abort me after a few steps", params, "victim")[0]
    other = big_llm.input_processor.process("Keep running to the end", params, "other")[0]
    engine.add_request(victim)
    engine.add_request(other)

    produced: dict[str, list[int]] = {"victim": [], "other": []}
    for _ in range(3):
        for out in engine.step().outputs:
            produced[out.request_id].extend(out.new_token_ids)
    assert len(produced["victim"]) == 3
    assert kv.get_block_ids("victim")
    num_other_blocks = len(kv.get_block_ids("other"))

    engine.abort_requests(["victim"])
    assert kv.get_block_ids("victim") == []
    assert kv.num_free_blocks == engine.info.num_kv_blocks - num_other_blocks
    assert "victim" not in engine.scheduler.requests

    step_outputs = [engine.step().outputs]
    assert "victim" not in runner_batch.row_of  # the runner dropped it in that step
    while engine.has_unfinished():
        step_outputs.append(engine.step().outputs)
    ids = {out.request_id for out in itertools.chain.from_iterable(step_outputs)}
    assert ids == {"other"}
    assert len(produced["victim"]) == 3
    engine.abort_requests(["victim", "never-existed"])  # unknown ids are ignored
    assert_all_blocks_free(big_llm)


def test_abort_of_a_waiting_request(big_llm):
    engine = big_llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    request = big_llm.input_processor.process("Never scheduled", params, "waiting-abort")[0]
    engine.add_request(request)
    engine.abort_requests(["waiting-abort"])
    assert not engine.has_unfinished()
    assert engine.step().outputs == []
    assert_all_blocks_free(big_llm)


def test_outputs_report_when_requests_were_first_scheduled(tiny_llm):
    # a 16-token budget: the later prompts wait behind the first one's chunks
    llm = tiny_llm("fcfs", True)
    outputs = llm.generate(PREEMPTION_PROMPTS, GREEDY)
    scheduled = []
    for output in outputs:
        m = output.metrics
        assert m.first_scheduled_time is not None
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
        scheduled.append(m.first_scheduled_time)
    assert scheduled == sorted(scheduled)  # first come, first scheduled
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("attention_backend", ["cpu_paged", "torch_paged"])
def test_profile_run_covers_a_budget_longer_than_a_sequence(tiny_llama_dir, attention_backend):
    # What a GPU platform runs before sizing the KV cache: the whole token budget (here 3.5
    # sequences of max_model_len) and as many logits rows as a step can sample.
    llm = make_llm(
        tiny_llama_dir,
        max_num_batched_tokens=7 * MAX_MODEL_LEN // 2,
        attention_backend=attention_backend,
    )
    runner = llm.engine.executor.worker.runner
    runner.profile_run(llm.config.max_num_batched_tokens)
    # the dummy cache was separate: the engine still works and every block is free
    assert_all_blocks_free(llm)
    assert llm.generate(PREEMPTION_PROMPTS[:1], GREEDY)[0].outputs[0].token_ids
