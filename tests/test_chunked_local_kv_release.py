"""Chunked local attention (Llama 4's RoPE layers, ``attention_chunk_size`` ``C``): the layers
get KV cache groups of their own (``KVCacheManager(group_chunks=...)``) that release every
block wholly before the chunk of a step's first position, while full-attention (NoPE) layers
keep theirs.

Unit tests drive the planner and the manager (release, null entries, prefix-cache hits inside
a chunk and across a chunk boundary, the per-request bound, a random-schedule invariant);
engine tests run the tiny Llama 4 of tests/test_llama4.py (chunks of 8, blocks of 4, prompts
of several chunks) to HF's greedy tokens with the release on: chunked prefill, both CPU
backends, prefix-cache hits, preemption, and a KV cache memory that fits only with the release.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from fixtures_models import save_tiny_checkpoint
from test_llama4 import CHUNK, tiny_config
from test_llm_parity import MAX_TOKENS, PROMPTS, hf_greedy
from test_sliding_window_groups import layer_blocks
from test_sliding_window_kv import (
    assert_references_are_holders,
    finish_or_sample,
    make_llm,
    run,
    schedule_randomly,
)

from chassis.core.block_pool import NULL_BLOCK_ID
from chassis.core.kv_cache_groups import (
    KVCacheGroupSpec,
    draft_layer_placement,
    plan_kv_cache_groups,
)
from chassis.core.kv_cache_manager import (
    KVCacheManager,
    _group_key,
    hash_block_tokens,
    max_group_blocks_per_request,
)
from chassis.core.request import Request
from chassis.core.sampling_params import SamplingParams

BLOCK = 4


def _request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=8))


# -- the groups ------------------------------------------------------------------------------


def test_chunked_layers_form_groups_after_the_full_ones() -> None:
    llama4 = plan_kv_cache_groups([None] * 4, [8, None, 8, None])
    assert llama4 == [KVCacheGroupSpec(None, (1, 3)), KVCacheGroupSpec(None, (0, 2), 8)]
    assert [g.keeps_every_position for g in llama4] == [True, False]
    # Scout's pattern over 48 layers: every 4th layer NoPE (full), so groups of 12
    scout = plan_kv_cache_groups([None] * 48, [None if i % 4 == 3 else 8192 for i in range(48)])
    assert [(g.chunk, len(g.layer_ids)) for g in scout] == [(None, 12)] + [(8192, 12)] * 3
    # one kind of layer: one group; a layer with a window and chunks: refused
    assert plan_kv_cache_groups([None] * 2, [8, 8]) == [KVCacheGroupSpec(None, (0, 1), 8)]
    with pytest.raises(ValueError, match="both a sliding window and attention chunks"):
        plan_kv_cache_groups([4, None], [8, None])


def test_no_draft_layer_reads_a_chunk_group() -> None:
    # a chunk group keeps only each request's current chunk: every draft layer goes full
    groups = plan_kv_cache_groups([None] * 4, [8, None, 8, None])
    assert draft_layer_placement(groups, [None, 4, None]) == ([0, 0, 0], [0, 1, 2])


# -- the manager -----------------------------------------------------------------------------


def test_blocks_before_the_steps_chunk_are_released_in_chunk_groups_only() -> None:
    kv = KVCacheManager(30, BLOCK, group_windows=[None, None], group_chunks=[None, 8])
    assert kv.num_usable_blocks == 29 and kv.sliding_window is None  # the null block
    a = _request("a", list(range(40)))
    assert kv.allocate_group_slots(a, 12) is not None  # 3 blocks in each group
    a.num_computed_tokens = 12
    # position 12's chunk starts at 8: blocks 0 and 1 (positions 0..7) go back
    new = kv.allocate_group_slots(a, 8)
    assert new is not None and [len(b) for b in new] == [2, 2]
    assert kv.group_num_null_blocks("a") == [0, 2]
    assert kv.get_block_ids("a", 1)[:2] == [NULL_BLOCK_ID] * 2
    assert NULL_BLOCK_ID not in kv.get_block_ids("a", 0) + kv.get_block_ids("a", 1)[2:]
    assert kv.num_held_blocks("a") == 5 + 3
    a.num_computed_tokens = 20
    # position 20's chunk starts at 16: blocks 2 and 3 too; a decode inside the chunk
    # releases nothing more
    assert kv.allocate_group_slots(a, 1) is not None
    assert kv.group_num_null_blocks("a") == [0, 4]
    a.num_computed_tokens = 21
    assert kv.allocate_group_slots(a, 1) is not None
    assert kv.group_num_null_blocks("a") == [0, 4]
    assert kv.num_free_blocks == 29 - 6 - 2
    kv.free(a)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_a_chunk_start_inside_a_block_keeps_that_block() -> None:
    kv = KVCacheManager(30, BLOCK, group_windows=[None, None], group_chunks=[None, 6])
    a = _request("a", list(range(30)))
    kv.allocate_group_slots(a, 7)
    a.num_computed_tokens = 7
    kv.allocate_group_slots(a, 6)  # chunk of 7 starts at 6, in block 1: only block 0 goes
    assert kv.group_num_null_blocks("a") == [0, 1]
    a.num_computed_tokens = 13
    kv.allocate_group_slots(a, 1)  # chunk of 13 starts at 12: blocks 0..2
    assert kv.group_num_null_blocks("a") == [0, 3]


def _cached(tokens: list[int], num_groups_chunks: list[int | None]) -> KVCacheManager:
    """A manager whose prefix cache holds every full block of ``tokens`` in each group."""
    kv = KVCacheManager(
        60, BLOCK, group_windows=[None] * len(num_groups_chunks), group_chunks=num_groups_chunks
    )
    a = _request("a", tokens)
    kv.allocate_group_slots(a, len(tokens))
    a.num_computed_tokens = len(tokens)
    kv.free(a)
    return kv


def _keys(tokens: list[int], num_blocks: int) -> list[bytes]:
    parent, keys = None, []
    for i in range(num_blocks):
        parent = hash_block_tokens(parent, tokens[i * BLOCK : (i + 1) * BLOCK])
        keys.append(parent)
    return keys


def test_a_hit_inside_a_chunk_needs_only_that_chunks_blocks() -> None:
    tokens = list(range(30))
    kv = _cached(tokens, [None, 8])
    keys = _keys(tokens, 7)
    pool = kv.block_pool
    # drop chunk-group blocks 0..5: a hit of 7 blocks (next query at 28, its chunk from 24)
    # needs block 6 only
    for i in range(6):
        pool.uncache_block(pool.get_cached_block(_group_key(1, keys[i])))
    hits, num_hit = kv.get_computed_group_blocks(_request("b", [*tokens, 99]))
    assert num_hit == 28
    assert hits[1] == [NULL_BLOCK_ID] * 6 + [pool.get_cached_block(_group_key(1, keys[6]))]
    assert hits[0] == [pool.get_cached_block(k) for k in keys]
    b = _request("b", [*tokens, 99])
    kv.get_computed_group_blocks(b)
    assert kv.allocate_group_slots(b, 3, hits, num_hit) is not None
    assert kv.group_num_null_blocks("b") == [0, 6]
    assert kv.num_held_blocks("b") == 8 + 2


def test_a_hit_at_a_chunk_boundary_needs_no_chunk_group_block() -> None:
    tokens = list(range(30))
    kv = _cached(tokens, [None, 8])
    keys = _keys(tokens, 7)
    pool = kv.block_pool
    # without chunk-group block 6, 7 blocks cannot be served; 6 blocks end at 24, a chunk
    # start: the next query reads only itself, so the chunk group needs nothing cached
    for i in (2, 6):
        pool.uncache_block(pool.get_cached_block(_group_key(1, keys[i])))
    hits, num_hit = kv.get_computed_group_blocks(_request("b", [*tokens, 99]))
    assert num_hit == 24 and hits[1] == [NULL_BLOCK_ID] * 6
    # the full group lost block 5: 5 blocks (next query at 20, its chunk from 16: block 4)
    pool.uncache_block(pool.get_cached_block(keys[5]))
    hits, num_hit = kv.get_computed_group_blocks(_request("c", [*tokens, 99]))
    assert num_hit == 20
    assert hits[1] == [NULL_BLOCK_ID] * 4 + [pool.get_cached_block(_group_key(1, keys[4]))]
    # ... and chunk-group block 4 as well: 4 blocks end at 16, a chunk start again
    pool.uncache_block(pool.get_cached_block(_group_key(1, keys[4])))
    hits, num_hit = kv.get_computed_group_blocks(_request("d", [*tokens, 99]))
    assert num_hit == 16 and hits[1] == [NULL_BLOCK_ID] * 4
    d = _request("d", [*tokens, 99])
    kv.get_computed_group_blocks(d)
    assert kv.allocate_group_slots(d, 15, hits, num_hit) is not None
    assert kv.group_num_null_blocks("d") == [0, 4]


def test_max_model_len_counts_a_chunk_and_a_step_in_chunk_groups() -> None:
    # the full group keeps 64 blocks of 256 tokens; the chunk group at most C - 1 positions
    # before the step's first and the step's 16: ceil((8 + 16 + 2) / 4) = 7 blocks
    assert max_group_blocks_per_request(256, 4, [None, None], 16, [None, 8]) == 64 + 7
    assert max_group_blocks_per_request(256, 4, [None, None], 16) == 128
    with pytest.raises(ValueError, match="chunk must be >= 1 and its window None"):
        KVCacheManager(8, 4, group_windows=[None, 4], group_chunks=[None, 8])
    with pytest.raises(ValueError, match="group_chunks has 1 groups"):
        KVCacheManager(8, 4, group_windows=[None, None], group_chunks=[8])


def test_random_schedules_with_chunk_groups_read_only_their_own_keys() -> None:
    """Random schedules (tests/test_sliding_window_kv.py's scheduler) over full, chunk and
    window groups sharing one pool whose block ids address the same slots whatever the group:
    every key a group's layers read sits in a block the request holds in that group, written
    by that group for the same tokens; a chunk group's table has the null block exactly in
    the blocks wholly before the chunk of the step's first position; a request never holds
    more than the bound; reference counts equal the holders."""
    for seed in range(60):
        rng = random.Random(seed)
        size, num_blocks = rng.randint(1, 4), rng.randint(14, 50)
        windows: list[int | None] = [None, None]
        chunks: list[int | None] = [None, rng.randint(1, 12)]
        for _ in range(rng.randint(0, 2)):
            kind = rng.choice(["full", "window", "chunk"])
            windows.append(rng.randint(1, 12) if kind == "window" else None)
            chunks.append(rng.randint(1, 12) if kind == "chunk" else None)
        kv = KVCacheManager(
            num_blocks,
            size,
            enable_prefix_caching=rng.random() < 0.9,
            group_windows=windows,
            group_chunks=chunks,
        )
        written: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}
        prefixes = [[rng.randint(0, 5) for _ in range(rng.randint(0, 24))] for _ in range(3)]
        waiting: list[Request] = []
        running: list[Request] = []
        for n in range(120):
            if rng.random() < 0.3 and len(waiting) + len(running) < 6:
                prompt = rng.choice(prefixes) + [rng.randint(0, 5) for _ in range(4)]
                waiting.append(Request(f"r{n}", prompt, SamplingParams(max_tokens=15)))
            scheduled = schedule_randomly(
                kv.allocate_group_slots, kv.get_computed_group_blocks, kv, running, waiting, rng
            )
            for request, num_new in scheduled:
                start = request.num_computed_tokens
                tokens = request.all_token_ids
                held = [
                    len(t) - c
                    for t, c in zip(
                        kv.get_group_block_ids(request.request_id),
                        [kv.num_null_blocks(request.request_id, g) for g in range(len(windows))],
                        strict=True,
                    )
                ]
                for group, (window, chunk) in enumerate(zip(windows, chunks, strict=True)):
                    table = kv.get_block_ids(request.request_id, group)
                    if chunk is not None:
                        chunk_start = start // chunk * chunk
                        assert kv.num_null_blocks(request.request_id, group) == (
                            chunk_start // size
                        ), (seed, request.request_id, group, start)
                        bound = max_group_blocks_per_request(10**6, size, [None], num_new, [chunk])
                        assert held[group] <= bound, (seed, group, held[group], bound)
                    for q in range(start, start + num_new):
                        written[table[q // size], q % size] = (group, tuple(tokens[: q + 1]))
                        if window is not None:
                            first = max(0, q - window + 1)
                        elif chunk is not None:
                            first = q // chunk * chunk
                        else:
                            first = 0
                        for key in range(first, q + 1):
                            block = table[key // size]
                            assert block != NULL_BLOCK_ID, (seed, group, q, key)
                            assert written.get((block, key % size)) == (
                                group,
                                tuple(tokens[: key + 1]),
                            ), (seed, request.request_id, group, q, key)
                request.num_computed_tokens = start + num_new
            finish_or_sample(kv, running, scheduled, rng)
            assert_references_are_holders(kv, running, seed)


# -- the engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/test_llama4.py's checkpoint: layers 0 and 2 chunked (8), 1 and 3 full."""
    return save_tiny_checkpoint(tiny_config(), tmp_path_factory.mktemp("llama4_chunks"), seed=4)


@pytest.fixture(scope="module")
def expected(llama4_dir: Path) -> list[list[int]]:
    return hf_greedy(llama4_dir, PROMPTS, MAX_TOKENS)


def test_outputs_equal_transformers_and_the_reference_with_fewer_layer_blocks(
    llama4_dir: Path, expected: list[list[int]]
) -> None:
    """Prefill chunked to 16 tokens over blocks of 4 (prompts up to several chunks long):
    HF's tokens with the release on (torch_paged and the CPU's cpu_paged) and off, the
    release holding fewer layer-blocks."""
    on = make_llm(llama4_dir, release=True)
    kv = on.engine.kv_cache_manager
    assert (kv.group_windows, kv.group_chunks) == ([None, None], [None, CHUNK])
    off = make_llm(llama4_dir, release=False)
    assert off.engine.kv_cache_manager.group_chunks == [None]
    released, most_released = run(on, PROMPTS)
    kept, most_kept = run(off, PROMPTS)
    assert released == kept == expected
    assert layer_blocks(on, most_released) < layer_blocks(off, most_kept)
    cpu = make_llm(llama4_dir, release=True, attention_backend="cpu_paged")
    assert run(cpu, PROMPTS)[0] == expected


def test_prefix_cache_hits_keep_outputs(llama4_dir: Path, expected: list[list[int]]) -> None:
    llm = make_llm(llama4_dir, release=True)
    kv = llm.engine.kv_cache_manager
    first, _ = run(llm, PROMPTS)
    hits_before = kv.prefix_cache_hits
    again, _ = run(llm, PROMPTS)
    assert first == again == expected
    assert kv.prefix_cache_hits > hits_before


def test_preemption_keeps_outputs(llama4_dir: Path, expected: list[list[int]]) -> None:
    tight = {"num_kv_blocks": 40, "max_model_len": 104, "enable_prefix_caching": False}
    llm = make_llm(llama4_dir, release=True, **tight)
    tokens, _ = run(llm, PROMPTS)
    assert tokens == expected
    assert llm.engine.scheduler.num_preemptions > 0


def test_a_cache_too_small_to_keep_every_block_serves_with_the_release(
    llama4_dir: Path, expected: list[list[int]]
) -> None:
    """160 KiB of KV cache (a layer-block of 4 positions is 1 KiB): kept whole, 40 blocks of
    every layer, fewer than the 64 that --max-model-len 256 needs, so the engine refuses to
    start; released, 80 block ids of 2 layers, of which one request holds at most 64 + 7."""
    memory = {"num_kv_blocks": None, "kv_cache_memory": 160 * 1024}
    with pytest.raises(ValueError, match="fewer than one sequence of --max-model-len 256"):
        make_llm(llama4_dir, release=False, **memory)
    llm = make_llm(llama4_dir, release=True, **memory)
    assert llm.engine.kv_cache_manager.num_usable_blocks == 79
    tokens, _ = run(llm, PROMPTS)
    assert tokens == expected
    # the start-up bound counts the chunk group's 7 blocks, not 64 (and the null block)
    with pytest.raises(ValueError, match=r"71 blocks over its 2 KV cache groups.*chunks"):
        make_llm(llama4_dir, release=True, num_kv_blocks=71)
    assert make_llm(llama4_dir, release=True, num_kv_blocks=72).engine.info.num_kv_blocks == 71
