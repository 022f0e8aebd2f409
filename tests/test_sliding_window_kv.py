"""Releasing the KV blocks a sliding window has left (``KVCacheManager(sliding_window=W)``).

Unit tests drive the manager and pool directly; engine tests run a tiny Mistral whose every
layer has a window of 6 (block size 4) and check, against HF transformers and against the
same engine with ``sliding_window_kv_release=False`` (the keep-everything reference), that
the tokens are identical while requests hold fewer blocks: chunked prefill, prefix-cache
hits, preemption, n-gram and draft-model speculation.
"""

from __future__ import annotations

import os
import random
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fixtures_models import save_tiny_checkpoint
from test_llm_parity import MAX_TOKENS, PROMPTS, hf_greedy
from test_sliding_window_models import tiny_config

from chassis import LLM, SamplingParams
from chassis.core.block_pool import NULL_BLOCK_ID, BlockPool
from chassis.core.kv_cache_manager import KVCacheManager, max_blocks_per_request
from chassis.core.request import Request

WINDOW = 6
BLOCK_SIZE = 4


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=8))


def step(kv: KVCacheManager, request: Request, num_tokens: int) -> list[int] | None:
    """One scheduled step of ``num_tokens`` (allocate, then count them computed)."""
    blocks = kv.allocate_slots(request, num_tokens)
    if blocks is not None:
        request.num_computed_tokens += num_tokens
    return blocks


def schedule_randomly(
    allocate: Callable[..., object],
    get_computed: Callable[[Request], tuple[Any, int]],
    kv: KVCacheManager,
    running: list[Request],
    waiting: list[Request],
    rng: random.Random,
) -> list[tuple[Request, int]]:
    """One step of the random-schedule tests' scheduler over a budget of 1 to 12 tokens
    drawn from ``rng``: running requests first, each preempting the last admitted (possibly
    itself) until ``allocate`` (``kv.allocate_slots`` or ``kv.allocate_group_slots``) gives
    it room, then waiting ones with their ``get_computed`` hits. Returns ``(request, number
    of new tokens)`` per scheduled request; their ``num_computed_tokens`` are not advanced."""
    budget = rng.randint(1, 12)
    scheduled: list[tuple[Request, int]] = []
    for request in list(running):
        if request not in running:
            continue  # preempted below for an earlier one
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        while num_new > 0:
            if allocate(request, num_new) is not None:
                scheduled.append((request, num_new))
                budget -= num_new
                break
            victim = running.pop()  # the last admitted, possibly itself
            kv.free(victim)
            victim.num_computed_tokens = 0
            waiting.insert(0, victim)
            scheduled = [(r, m) for r, m in scheduled if r is not victim]
            if victim is request:
                break
    while waiting and budget > 0:
        request = waiting[0]
        hits, num_hit = get_computed(request)
        num_new = min(request.num_tokens - num_hit, budget)
        if allocate(request, num_new, hits, num_hit) is None:
            break
        request.num_computed_tokens = num_hit
        running.append(waiting.pop(0))
        scheduled.append((request, num_new))
        budget -= num_new
    return scheduled


def finish_or_sample(
    kv: KVCacheManager,
    running: list[Request],
    scheduled: list[tuple[Request, int]],
    rng: random.Random,
) -> None:
    """After a step: a scheduled request with every token computed is freed if it has all
    its output tokens, else it gets a random next token (0 to 5) from ``rng``."""
    for request, _ in scheduled:
        if request.num_computed_tokens == request.num_tokens:
            if len(request.output_token_ids) == request.sampling_params.max_tokens:
                kv.free(request)
                running.remove(request)
            else:
                request.output_token_ids.append(rng.randint(0, 5))


def assert_references_are_holders(kv: KVCacheManager, running: list[Request], seed: int) -> None:
    """Each block's reference count (the null block aside) is the number of entries in the
    ``running`` requests' block tables, every group's, that name it."""
    holders: dict[int, int] = defaultdict(int)
    for request in running:
        for table in kv.get_group_block_ids(request.request_id):
            for block in table:
                if block != NULL_BLOCK_ID:
                    holders[block] += 1
    for block in range(1, kv.num_blocks):
        assert kv.block_pool.ref_count(block) == holders[block], (seed, block)


# -- the pool and the manager --------------------------------------------------------------


def test_the_null_block_is_never_handed_out_freed_or_cached() -> None:
    pool = BlockPool(4, reserve_null_block=True)
    assert pool.num_usable_blocks == pool.num_free_blocks == 3
    blocks = pool.get_new_blocks(3)
    assert NULL_BLOCK_ID not in blocks and pool.usage == 1.0
    for call in (
        lambda: pool.free_blocks([NULL_BLOCK_ID]),
        lambda: pool.touch([NULL_BLOCK_ID]),
        lambda: pool.cache_block(NULL_BLOCK_ID, b"h"),
    ):
        with pytest.raises(ValueError, match="null block"):
            call()
    with pytest.raises(ValueError, match="null block"):
        BlockPool(1, reserve_null_block=True)


def test_blocks_behind_the_window_are_released_as_the_request_advances() -> None:
    kv = KVCacheManager(num_blocks=9, block_size=BLOCK_SIZE, sliding_window=WINDOW)
    request = make_request("a", list(range(100, 130)))
    assert kv.num_free_blocks == 8  # one block is the null block
    step(kv, request, 10)  # positions 0..9: blocks 0..2
    assert kv.num_null_blocks("a") == 0 and kv.num_held_blocks("a") == 3
    # The next step starts at 10 and reads keys from 10 - 6 + 1 = 5 on: block 0 goes.
    step(kv, request, 6)
    assert kv.num_null_blocks("a") == 1
    assert kv.get_block_ids("a")[0] == NULL_BLOCK_ID
    assert kv.num_held_blocks("a") == 3  # blocks 1..3 (positions 4..15)
    # From 16: keys from 11 on, blocks 0..1 wholly before it.
    step(kv, request, 14)
    assert kv.num_null_blocks("a") == 2 and kv.num_held_blocks("a") == 6
    request.output_token_ids.append(7)
    step(kv, request, 1)  # from 30: keys from 25 on, blocks 0..5 go
    assert kv.num_null_blocks("a") == 6 and kv.num_held_blocks("a") == 2
    assert kv.num_free_blocks == 6
    kv.free(request)
    assert kv.num_free_blocks == 8


def test_max_blocks_per_request_is_what_the_manager_holds_at_worst() -> None:
    """The bound the start-up checks use is exact: steps of ``n`` tokens from every
    alignment never hold more, and some alignment holds that many."""
    for window in range(1, 10):
        for block_size in range(1, 6):
            for n in range(1, 8):
                worst = 0
                for first in range(1, n + 1):  # the first chunk sets the alignment
                    kv = KVCacheManager(
                        num_blocks=64,
                        block_size=block_size,
                        enable_prefix_caching=False,
                        sliding_window=window,
                    )
                    request = make_request("a", list(range(60)))
                    size = first
                    while request.num_computed_tokens < 60:
                        size = min(size, 60 - request.num_computed_tokens)
                        assert step(kv, request, size) is not None
                        worst = max(worst, kv.num_held_blocks("a"))
                        size = n
                bound = max_blocks_per_request(10**6, block_size, window, n)
                assert worst == bound, (window, block_size, n)
    # a short max_model_len caps it; without a window it is the whole length
    assert max_blocks_per_request(8, 4, 6, 16) == 2
    assert max_blocks_per_request(256, 4, None, 16) == 64


def test_a_window_of_one_position_keeps_only_the_current_block() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, sliding_window=1)
    request = make_request("a", list(range(5)))
    step(kv, request, 5)
    for token in range(20):
        request.output_token_ids.append(token)
        assert step(kv, request, 1) is not None
        assert kv.num_held_blocks("a") == 1  # only the block of its own position
    kv.free(request)
    assert kv.num_free_blocks == 3


def test_released_blocks_stay_prefix_cache_hits_and_hits_skip_what_the_window_left() -> None:
    # 7 usable blocks, all of which request a takes: its freed blocks are the free list.
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, sliding_window=WINDOW)
    tokens = list(range(200, 224))  # 6 full blocks
    a = make_request("a", tokens)
    for _ in range(6):
        step(kv, a, 4)
    a.output_token_ids.append(1)
    step(kv, a, 1)  # releases blocks 0..3 (keys from 24 - 5 = 19 on), cached first
    released = kv.block_pool.num_cached_blocks
    kv.free(a)
    assert released == 6
    # Evict the first two cached blocks (released first, so first in the free list).
    other = make_request("other", list(range(900, 908)))
    step(kv, other, 8)
    assert kv.block_pool.num_cached_blocks == 4
    # The same prompt plus more: the hit needs only the blocks the window of its first
    # computed position reads, so it reaches past the evicted ones.
    b = make_request("b", [*tokens, 5, 6, 7])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 24
    first_needed = (24 - WINDOW + 1) // BLOCK_SIZE
    assert hits[:first_needed] == [NULL_BLOCK_ID] * first_needed
    assert NULL_BLOCK_ID not in hits[first_needed:]
    assert kv.allocate_slots(b, 3, hits, num_hit) is not None
    assert kv.num_null_blocks("b") == first_needed
    # Without the window the hit stops at the first evicted block.
    plain = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    assert plain.get_computed_blocks(make_request("c", [*tokens, 5]))[1] == 0


def test_a_hit_is_cut_where_the_window_needs_a_missing_block() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, sliding_window=WINDOW)
    tokens = list(range(300, 316))  # 4 full blocks
    a = make_request("a", tokens)
    step(kv, a, 16)
    a.output_token_ids.append(1)
    step(kv, a, 1)
    kv.free(a)
    # Drop block 2's hash: a hit of 4 blocks (next query at 16 reads from 11: blocks 2, 3)
    # or 3 (reads from 7: blocks 1, 2) is impossible; 2 blocks (reads from 3: 0, 1) is not.
    kv.block_pool.uncache_block(kv.block_pool.get_cached_block(_hash(kv, tokens, 3)))
    hits, num_hit = kv.get_computed_blocks(make_request("b", [*tokens, 9]))
    assert num_hit == 8 and NULL_BLOCK_ID not in hits


def test_random_schedules_read_only_their_own_keys_and_count_references() -> None:
    """Requests over shared prefixes, hits, chunks, decodes and preemptions in random
    schedules (fixed seeds): every key a step's window reads sits in a block the request
    holds and was written by a request with the same tokens up to it (a released block
    reused by another request would show), no step writes or reads the null block, and
    each block's reference count is the number of requests holding it."""
    for seed in range(100):
        rng = random.Random(seed)
        size, window, num_blocks = rng.randint(1, 4), rng.randint(1, 12), rng.randint(6, 30)
        kv = KVCacheManager(
            num_blocks, size, enable_prefix_caching=rng.random() < 0.9, sliding_window=window
        )
        # (block, offset) -> the tokens up to and including the position written there
        written: dict[tuple[int, int], tuple[int, ...]] = {}
        prefixes = [[rng.randint(0, 5) for _ in range(rng.randint(0, 20))] for _ in range(3)]
        waiting: list[Request] = []
        running: list[Request] = []
        for n in range(150):
            if rng.random() < 0.3 and len(waiting) + len(running) < 6:
                prompt = rng.choice(prefixes) + [rng.randint(0, 5) for _ in range(4)]
                params = SamplingParams(max_tokens=rng.randint(1, 20))
                waiting.append(Request(f"r{n}", prompt, params))
            scheduled = schedule_randomly(
                kv.allocate_slots, kv.get_computed_blocks, kv, running, waiting, rng
            )
            for request, num_new in scheduled:  # the step: write, then read each window
                start = request.num_computed_tokens
                table = kv.get_block_ids(request.request_id)
                tokens = request.all_token_ids
                for q in range(start, start + num_new):
                    written[table[q // size], q % size] = tuple(tokens[: q + 1])
                    for key in range(max(0, q - window + 1), q + 1):
                        assert table[key // size] != NULL_BLOCK_ID, (seed, q, key)
                        assert written.get((table[key // size], key % size)) == tuple(
                            tokens[: key + 1]
                        ), (seed, request.request_id, q, key)
                request.num_computed_tokens = start + num_new
            finish_or_sample(kv, running, scheduled, rng)
            assert_references_are_holders(kv, running, seed)


def _hash(kv: KVCacheManager, tokens: list[int], num_blocks: int) -> bytes:
    from chassis.core.kv_cache_manager import hash_block_tokens

    parent = None
    for i in range(num_blocks):
        parent = hash_block_tokens(parent, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
    assert parent is not None
    return parent


# -- the engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Mistral whose two layers both attend over the last ``WINDOW`` positions."""
    return save_tiny_checkpoint(
        tiny_config("mistral", WINDOW), tmp_path_factory.mktemp("mistral"), seed=3
    )


@pytest.fixture(scope="module")
def expected(mistral_dir: Path) -> list[list[int]]:
    return hf_greedy(mistral_dir, PROMPTS, MAX_TOKENS)


def make_llm(model_dir: Path, release: bool, **engine: Any) -> LLM:
    settings: dict[str, Any] = {
        "dtype": "float32",
        "max_model_len": 256,
        "num_kv_blocks": 128,
        "block_size": BLOCK_SIZE,
        "max_num_batched_tokens": 16,  # chunked prefill of the longer prompts
        "attention_backend": "torch_paged",
        **engine,
    }
    return LLM(str(model_dir), sliding_window_kv_release=release, **settings)


def run(llm: LLM, prompts: list[str], max_tokens: int = MAX_TOKENS) -> tuple[list[list[int]], int]:
    """Greedy tokens of each prompt, stepping the engine core, and the most blocks any one
    request held after any step; checks that every block is free at the end."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine, kv = llm.engine, llm.engine.kv_cache_manager
    ids = []
    for i, prompt in enumerate(prompts):
        request = llm.input_processor.process(prompt, params, f"r{i}")[0]
        engine.add_request(request)
        ids.append(request.request_id)
    tokens: dict[str, list[int]] = defaultdict(list)
    most_held = 0
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for out in engine.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
        most_held = max([most_held] + [kv.num_held_blocks(r) for r in ids])
    assert not engine.has_unfinished()
    assert kv.num_free_blocks == kv.num_usable_blocks
    return [tokens[r] for r in ids], most_held


def held_bound(num_step_tokens: int) -> int:
    """The most blocks a request can hold right after a step of ``num_step_tokens`` tokens:
    positions ``c - W + 1 .. c + n - 1``, plus a partial block at each end."""
    return (num_step_tokens + WINDOW - 1) // BLOCK_SIZE + 2


def test_outputs_equal_transformers_and_the_reference_with_fewer_blocks(
    mistral_dir: Path, expected: list[list[int]]
) -> None:
    released, most_released = run(make_llm(mistral_dir, release=True), PROMPTS)
    kept, most_kept = run(make_llm(mistral_dir, release=False), PROMPTS)
    assert released == kept == expected
    # The longest prompt (86 tokens) holds 24 blocks without release before its last step.
    assert most_kept == 24
    assert most_released <= held_bound(16) < most_kept


def test_the_default_cpu_backend_reads_null_blocks_correctly(
    mistral_dir: Path, expected: list[list[int]]
) -> None:
    # cpu_paged's kernels start at the window; its SDPA paths gather and mask the null block
    tokens, most_held = run(
        make_llm(mistral_dir, release=True, attention_backend="cpu_paged"), PROMPTS
    )
    assert tokens == expected
    assert most_held <= held_bound(16)


def test_the_engine_reports_the_window_only_when_releasing(mistral_dir: Path) -> None:
    on, off = make_llm(mistral_dir, release=True), make_llm(mistral_dir, release=False)
    assert on.engine.info.kv_cache_window == on.engine.kv_cache_manager.sliding_window == WINDOW
    assert on.engine.info.num_kv_blocks == 127  # one block is the null block
    assert off.engine.info.kv_cache_window is None
    assert off.engine.info.num_kv_blocks == 128


def test_max_model_len_needs_only_what_a_windowed_request_holds(
    mistral_dir: Path, expected: list[list[int]]
) -> None:
    """--max-model-len 256 (64 blocks kept whole) starts with release on in 7 blocks: a
    request holds at most ceil((6 + 16 + 4 - 2) / 4) = 6 of them, plus the null block; one
    fewer is refused, and so are 7 with release off. The five prompts then run one or two
    at a time and still give HF's tokens."""
    with pytest.raises(ValueError, match="fewer than one request of --max-model-len 256"):
        make_llm(mistral_dir, release=True, num_kv_blocks=6)
    with pytest.raises(
        ValueError, match=r"fewer than one sequence of --max-model-len 256.*raise --num-kv-blocks"
    ):
        make_llm(mistral_dir, release=False, num_kv_blocks=7)
    llm = make_llm(mistral_dir, release=True, num_kv_blocks=7, enable_prefix_caching=False)
    assert llm.engine.info.num_kv_blocks == 6
    tokens, most_held = run(llm, PROMPTS)
    assert tokens == expected
    assert most_held <= 6


def test_models_with_full_attention_layers_get_a_block_table_per_group(tmp_path: Path) -> None:
    # Qwen2 with max_window_layers=1: layer 0 attends to everything, layer 1 slides; they
    # become two KV cache groups (tests/test_sliding_window_groups.py), not one window
    qwen2 = save_tiny_checkpoint(tiny_config("qwen2", 5), tmp_path / "qwen2", seed=3)
    kv = make_llm(qwen2, release=True).engine.kv_cache_manager
    assert kv.sliding_window is None and kv.group_windows == [None, 5]


def test_prefix_cache_hits_keep_outputs(mistral_dir: Path, expected: list[list[int]]) -> None:
    llm = make_llm(mistral_dir, release=True)
    kv = llm.engine.kv_cache_manager
    first, _ = run(llm, PROMPTS)
    hits_before = kv.prefix_cache_hits
    again, most_held = run(llm, PROMPTS)
    assert first == again == expected
    assert kv.prefix_cache_hits > hits_before  # released blocks stayed cache entries
    assert most_held <= held_bound(16)


def test_preemption_keeps_outputs_and_release_preempts_less(
    mistral_dir: Path, expected: list[list[int]]
) -> None:
    # 27 blocks: the five prompts (1 to 86 tokens) with their 12 tokens need 50 kept whole,
    # the longest alone 25.
    tight = {"num_kv_blocks": 27, "max_model_len": 104, "enable_prefix_caching": False}
    released_llm = make_llm(mistral_dir, release=True, **tight)
    kept_llm = make_llm(mistral_dir, release=False, **tight)
    released, _ = run(released_llm, PROMPTS)
    kept, _ = run(kept_llm, PROMPTS)
    assert released == kept == expected
    kept_preemptions = kept_llm.engine.scheduler.num_preemptions
    assert kept_preemptions > 0
    assert released_llm.engine.scheduler.num_preemptions < kept_preemptions


def test_async_scheduling_keeps_outputs(mistral_dir: Path, expected: list[list[int]]) -> None:
    # a plan is made while the one before it is in flight: releasing from its first position
    # on is still safe, the device runs the plans in order
    llm = make_llm(mistral_dir, release=True, async_scheduling=True)
    tokens, most_held = run(llm, PROMPTS)
    assert tokens == expected
    assert most_held <= held_bound(16)


def test_ngram_speculation_keeps_outputs(mistral_dir: Path) -> None:
    prompts = ["1 2 3 1 2 3 1 2 3 1 2 3 1 2 3 1 2", *PROMPTS[:2]]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    expected = hf_greedy(mistral_dir, prompts, 16)
    llm = make_llm(mistral_dir, release=True, speculative_config=spec)
    tokens, most_held = run(llm, prompts, 16)
    assert tokens == expected
    assert llm.engine.scheduler.spec_num_draft_tokens > 0
    assert most_held <= held_bound(16)


def test_a_draft_model_with_the_same_window_keeps_outputs(
    mistral_dir: Path, expected: list[list[int]]
) -> None:
    spec = {"model": str(mistral_dir), "num_speculative_tokens": 3}
    llm = make_llm(mistral_dir, release=True, speculative_config=spec)
    assert llm.engine.kv_cache_manager.sliding_window == WINDOW
    tokens, most_held = run(llm, PROMPTS)
    assert tokens == expected
    assert llm.engine.scheduler.spec_num_accepted_tokens > 0
    assert most_held <= held_bound(16 + 3)


def test_a_draft_model_with_full_attention_turns_release_off(
    mistral_dir: Path, tiny_llama_dir: Path
) -> None:
    spec = {"model": str(tiny_llama_dir), "num_speculative_tokens": 2}
    llm = make_llm(mistral_dir, release=True, speculative_config=spec)
    assert llm.engine.kv_cache_manager.sliding_window is None


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_ranks_null_the_same_block_table_entries(
    mistral_dir: Path, expected: list[list[int]]
) -> None:
    # every rank's runner gets CachedRequestData.num_null_blocks through the plan it decodes
    llm = make_llm(mistral_dir, release=True, tensor_parallel_size=2)
    assert llm.engine.kv_cache_manager.sliding_window == WINDOW
    tokens, most_held = run(llm, PROMPTS)
    llm.shutdown()
    assert tokens == expected
    assert most_held <= held_bound(16)


def test_lora_requests_keep_outputs_and_their_own_cache_entries(
    mistral_dir: Path, tmp_path: Path
) -> None:
    from fixtures_lora import hf_greedy as hf_greedy_ids
    from fixtures_lora import hf_merged_model, write_peft_adapter

    from chassis.core.lora import LoRARequest

    adapter = write_peft_adapter(tmp_path / "a", mistral_dir, rank=8, alpha=16)
    lora = LoRARequest("a", 1, str(adapter))
    prompts = [list(range(300, 340)), [*range(300, 330), 7, 8]]  # a shared prefix
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm = make_llm(mistral_dir, release=True, enable_lora=True)
    # each prompt with the adapter, then without: hits never cross adapters
    got = [
        list(o.outputs[0].token_ids)
        for o in llm.generate(prompts * 2, params, lora_request=[lora, lora, None, None])
    ]
    merged = hf_merged_model(mistral_dir, adapter)
    base = hf_merged_model(mistral_dir, None)
    assert got[:2] == [hf_greedy_ids(merged, p, 10) for p in prompts]
    assert got[2:] == [hf_greedy_ids(base, p, 10) for p in prompts]
    assert llm.engine.kv_cache_manager.prefix_cache_hits > 0
