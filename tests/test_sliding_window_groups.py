"""Models that mix sliding-window and full-attention layers: one KV cache group per kind
(``KVCacheManager(group_windows=...)``), the window groups releasing what their window left.

Unit tests drive the group planner and the manager; engine tests run tiny random Gemma 2
(4 layers, alternating), Gemma 3 (6 layers, 5 sliding : 1 full) and gpt-oss checkpoints and
check, against HF transformers and against the same engine with
``sliding_window_kv_release=False`` (one block table, every position kept), that the tokens
are identical while requests hold fewer layer-blocks: chunked prefill, prefix-cache hits,
preemption, async scheduling, n-gram speculation and two tensor-parallel ranks.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from test_gemma_models import hf_greedy as gemma_hf_greedy
from test_gemma_models import write_checkpoint as write_gemma
from test_llm_parity import MAX_TOKENS, PROMPTS
from test_sliding_window_kv import (
    assert_references_are_holders,
    finish_or_sample,
    make_llm,
    run,
    schedule_randomly,
)

from chassis.core.block_pool import NULL_BLOCK_ID
from chassis.core.engine_core import EngineInfo
from chassis.core.kv_cache_groups import (
    KVCacheGroupSpec,
    draft_layer_placement,
    layer_placement,
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

SLIDING, FULL = "sliding_attention", "full_attention"


# -- the groups ------------------------------------------------------------------------------


def test_draft_layers_go_to_groups_that_keep_what_they_read() -> None:
    full, window4 = KVCacheGroupSpec(None, (1, 3)), KVCacheGroupSpec(4, (0, 2))
    # Gemma 2 drafting for Gemma 2: window layers on the window group, two tensors
    assert draft_layer_placement([full, window4], [4, None, 4, None]) == (
        [1, 0, 1, 0],
        [0, 0, 1, 1],
    )
    # full layers only fit a full group; a window wider than the group's does not fit it
    assert draft_layer_placement([full, window4], [None] * 3) == ([0, 0, 0], [0, 1, 2])
    assert draft_layer_placement([full, window4], [8, 2]) == ([0, 1], [0, 0])
    # several full groups share the full layers; the most constrained layers go first
    groups = [KVCacheGroupSpec(None, (0,)), KVCacheGroupSpec(None, (1,)), KVCacheGroupSpec(5, (2,))]
    assert draft_layer_placement(groups, [3, None, None, None, None, 5]) == (
        [2, 0, 1, 0, 1, 2],
        [0, 0, 0, 1, 1, 1],
    )
    with pytest.raises(ValueError, match="full-attention group"):
        draft_layer_placement([window4, full], [None])


def test_groups_have_one_size_and_full_groups_come_first() -> None:
    gemma2 = plan_kv_cache_groups([4, None, 4, None])
    assert gemma2 == [KVCacheGroupSpec(None, (1, 3)), KVCacheGroupSpec(4, (0, 2))]
    assert layer_placement(gemma2, 4) == ([1, 0, 1, 0], [0, 0, 1, 1])
    # Gemma 3's 5:1 over 12 layers: 2 full layers, so groups of 2 (5 sliding groups)
    gemma3 = plan_kv_cache_groups([5, 5, 5, 5, 5, None] * 2)
    assert [g.window for g in gemma3] == [None, 5, 5, 5, 5, 5]
    assert [g.layer_ids for g in gemma3] == [(5, 11), (0, 1), (2, 3), (4, 6), (7, 8), (9, 10)]
    # a kind with a remainder ends with a smaller group
    assert [g.layer_ids for g in plan_kv_cache_groups([None, None, 3, 3, 3])] == [
        (0, 1),
        (2, 3),
        (4,),
    ]
    assert plan_kv_cache_groups([None, None]) == [KVCacheGroupSpec(None, (0, 1))]


# -- the manager -----------------------------------------------------------------------------

BLOCK = 4


def _request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=8))


def test_only_window_groups_release_and_allocation_is_all_or_nothing() -> None:
    kv = KVCacheManager(12, BLOCK, group_windows=[None, 6])
    assert kv.sliding_window is None and kv.num_usable_blocks == 11  # the null block
    a = _request("a", list(range(20)))
    assert kv.allocate_group_slots(a, 12) is not None  # 3 blocks in each group
    a.num_computed_tokens = 12
    assert kv.num_held_blocks("a") == 6
    new = kv.allocate_group_slots(a, 8)  # the window of position 12 starts at 7: block 1
    assert new is not None and [len(b) for b in new] == [2, 2]
    assert kv.group_num_null_blocks("a") == [0, 1]
    assert kv.get_block_ids("a", 1)[0] == NULL_BLOCK_ID
    assert NULL_BLOCK_ID not in kv.get_block_ids("a", 0)
    a.num_computed_tokens = 20
    # a holds 5 full-group blocks and 4 window-group ones (the first released): 2 are free,
    # and b needs 5 in each group
    before = (kv.get_group_block_ids("a"), kv.num_free_blocks)
    b = _request("b", list(range(100, 120)))
    assert kv.allocate_group_slots(b, 20) is None  # 5 + 5 blocks: not there
    assert (kv.get_group_block_ids("a"), kv.num_free_blocks) == before  # nothing taken
    assert kv.get_group_block_ids("b") == [[], []]
    kv.free(a)
    assert kv.num_free_blocks == kv.num_usable_blocks
    with pytest.raises(ValueError, match="one KV cache group"):
        kv.allocate_slots(a, 1)


def test_each_group_caches_its_own_blocks_and_a_hit_serves_every_group() -> None:
    kv = KVCacheManager(40, BLOCK, group_windows=[None, 5])
    tokens = list(range(30))
    a = _request("a", tokens)
    kv.allocate_group_slots(a, 30)
    a.num_computed_tokens = 30
    kv.free(a)  # registers 7 full blocks in each group, under different keys
    assert kv.block_pool.num_cached_blocks == 14
    b = _request("b", [*tokens, 99])
    hits, num_hit = kv.get_computed_group_blocks(b)
    assert num_hit == 28
    full, window = hits
    assert len(full) == len(window) == 7 and NULL_BLOCK_ID not in full
    # position 28's window reads from 24: only block 6 of the window group
    assert window[:6] == [NULL_BLOCK_ID] * 6 and window[6] != NULL_BLOCK_ID
    assert not set(full) & set(window)
    new = kv.allocate_group_slots(b, 3, hits, num_hit)
    assert new is not None and kv.group_num_null_blocks("b") == [0, 6]


def test_a_hit_is_the_longest_prefix_every_group_serves() -> None:
    # the window group lost a block the full group still has: the hit shrinks until the
    # window group can serve it (its own rule) and the full group has the prefix
    kv = KVCacheManager(40, BLOCK, group_windows=[None, 5])
    tokens = list(range(30))
    a = _request("a", tokens)
    kv.allocate_group_slots(a, 30)
    a.num_computed_tokens = 30
    kv.free(a)
    parent = None
    keys = []
    for i in range(7):
        parent = hash_block_tokens(parent, tokens[i * BLOCK : (i + 1) * BLOCK])
        keys.append(parent)
    kv.block_pool.uncache_block(kv.block_pool.get_cached_block(_group_key(1, keys[5])))
    # k = 7 needs window block 6 only -> still served
    hits, num_hit = kv.get_computed_group_blocks(_request("b", [*tokens, 99]))
    assert num_hit == 28
    # drop full block 6: k = 6 needs window blocks 5 (gone) -> k = 5 (window reads 16..: 4)
    kv.block_pool.uncache_block(kv.block_pool.get_cached_block(keys[6]))
    hits, num_hit = kv.get_computed_group_blocks(_request("c", [*tokens, 99]))
    assert num_hit == 20
    assert hits[1] == [NULL_BLOCK_ID] * 4 + [kv.block_pool.get_cached_block(_group_key(1, keys[4]))]


def test_max_model_len_counts_every_groups_blocks() -> None:
    # the full group keeps 64 blocks of 256 tokens, the window group what a window of 6 and a
    # step of 16 cover
    assert max_group_blocks_per_request(256, 4, [None, 6], 16) == 64 + 6
    assert max_group_blocks_per_request(256, 4, [6], 16) == 6


def test_the_reported_capacity_divides_the_blocks_among_the_groups() -> None:
    # every position a request holds takes a block in each group: 128 ids of 16 tokens over
    # two groups hold 1024 positions at once, not 2048 (vLLM reports it so too)
    info = EngineInfo(
        platform="cpu",
        attention_backend="a",
        scheduler="s",
        sampler="d",
        num_kv_blocks=128,
        block_size=16,
        max_model_len=256,
        kv_cache_group_windows=(None, 4),
    )
    assert info.kv_capacity_tokens == 1024
    assert msgspec.structs.replace(info, kv_cache_group_windows=(None,)).kv_capacity_tokens == 2048


def test_random_schedules_with_mixed_groups_read_only_their_own_keys() -> None:
    """The all-sliding invariant test (tests/test_sliding_window_kv.py) with groups of
    different windows, full ones included, sharing one pool whose block ids address the
    same slots whatever the group (as the runner's shared cache tensors do): every key a
    group's layers read sits in a block the request holds in that group, written for the
    same tokens; no step reads the null block; reference counts equal the holders."""
    for seed in range(60):
        rng = random.Random(seed)
        size, num_blocks = rng.randint(1, 4), rng.randint(12, 50)
        windows: list[int | None] = [None, rng.randint(1, 12)] + [
            rng.choice([None, rng.randint(1, 12)]) for _ in range(rng.randint(0, 2))
        ]
        kv = KVCacheManager(
            num_blocks, size, enable_prefix_caching=rng.random() < 0.9, group_windows=windows
        )
        # (block, offset) -> (group, the tokens up to and including the position written)
        written: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}
        prefixes = [[rng.randint(0, 5) for _ in range(rng.randint(0, 20))] for _ in range(3)]
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
                for group, window in enumerate(windows):
                    table = kv.get_block_ids(request.request_id, group)
                    for q in range(start, start + num_new):
                        written[table[q // size], q % size] = (group, tuple(tokens[: q + 1]))
                        first = 0 if window is None else max(0, q - window + 1)
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
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 2, 4 layers alternating a window of 4 and full attention: 2 groups of 2."""
    return write_gemma(
        "gemma2",
        tmp_path_factory.mktemp("gemma2_groups"),
        num_hidden_layers=4,
        layer_types=[SLIDING, FULL] * 2,
    )


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3, 6 layers: 5 with a window of 5, then a full one: 6 groups of 1."""
    return write_gemma(
        "gemma3",
        tmp_path_factory.mktemp("gemma3_groups"),
        num_hidden_layers=6,
        layer_types=[SLIDING] * 5 + [FULL],
    )


@pytest.fixture(scope="module")
def gemma2_expected(gemma2_dir: Path) -> list[list[int]]:
    return gemma_hf_greedy(gemma2_dir, PROMPTS, MAX_TOKENS)


def layer_blocks(llm: Any, most_held: int) -> int:
    """``most_held`` block ids in layer-blocks: a block id of a grouped engine holds one
    group's layers, of a single-table engine every layer's."""
    runner = llm.engine.executor.worker.runner
    return most_held * runner._num_cache_tensors()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_outputs_equal_transformers_and_the_reference_with_fewer_layer_blocks(
    arch: str, gemma2_dir: Path, gemma3_dir: Path, gemma2_expected: list[list[int]]
) -> None:
    model_dir = gemma2_dir if arch == "gemma2" else gemma3_dir
    expected = gemma2_expected if arch == "gemma2" else gemma_hf_greedy(model_dir, PROMPTS, 12)
    on, off = make_llm(model_dir, release=True), make_llm(model_dir, release=False)
    windows = on.engine.kv_cache_manager.group_windows
    assert windows == ([None, 4] if arch == "gemma2" else [None] + [5] * 5)
    assert on.engine.info.kv_cache_group_windows == tuple(windows)
    assert off.engine.kv_cache_manager.group_windows == [None]
    released, most_released = run(on, PROMPTS)
    kept, most_kept = run(off, PROMPTS)
    assert released == kept == expected
    assert layer_blocks(on, most_released) < layer_blocks(off, most_kept)


def test_every_groups_metadata_reaches_the_device_in_one_copy_per_step(
    gemma2_dir: Path, gemma2_expected: list[list[int]]
) -> None:
    """HF's tokens, with each eager step's attention metadata (both groups' tables and slots,
    query_start_loc, seq_lens) handed to the copy as one tensor and none of it to the
    per-array copy (which receives int64 ids, positions and sample indices only)."""
    llm = make_llm(gemma2_dir, release=True)
    runner = llm.engine.executor.worker.runner
    assert runner.layer_group is not None and max(runner.layer_group) == 1  # 2 groups
    packed: list[torch.Tensor] = []
    per_array: list[np.ndarray] = []
    forwards = 0
    copy_metadata, to_device, forward = runner._copy_metadata, runner._to_device, runner.forward

    def count_packed(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(tensor)
        return copy_metadata(tensor)

    def count_per_array(array: np.ndarray) -> torch.Tensor:
        per_array.append(array)
        return to_device(array)

    def count_forwards(*args: Any) -> torch.Tensor:
        nonlocal forwards
        forwards += 1
        return forward(*args)

    runner._copy_metadata, runner._to_device = count_packed, count_per_array
    runner.forward = count_forwards
    tokens, _ = run(llm, PROMPTS)
    assert tokens == gemma2_expected
    assert forwards > len(PROMPTS) and len(packed) == forwards
    assert all(t.dtype == torch.int32 and t.dim() == 1 for t in packed)
    assert not [a for a in per_array if a.dtype == np.int32]  # no block table or lengths


def test_prefix_cache_hits_keep_outputs(gemma2_dir: Path, gemma2_expected: list[list[int]]) -> None:
    llm = make_llm(gemma2_dir, release=True)
    kv = llm.engine.kv_cache_manager
    first, _ = run(llm, PROMPTS)
    hits_before = kv.prefix_cache_hits
    again, _ = run(llm, PROMPTS)
    assert first == again == gemma2_expected
    assert kv.prefix_cache_hits > hits_before


def test_preemption_keeps_outputs(gemma2_dir: Path, gemma2_expected: list[list[int]]) -> None:
    # 40 block ids: the longest prompt (86 tokens + 12) alone holds 25 full-group blocks and
    # up to 6 window-group ones; all five together need more
    tight = {"num_kv_blocks": 40, "max_model_len": 104, "enable_prefix_caching": False}
    llm = make_llm(gemma2_dir, release=True, **tight)
    tokens, _ = run(llm, PROMPTS)
    assert tokens == gemma2_expected
    assert llm.engine.scheduler.num_preemptions > 0


def test_the_engine_starts_in_every_groups_worst_case(
    gemma2_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # --max-model-len 256 in blocks of 4: 64 full-group blocks, 6 window-group ones, the null
    with pytest.raises(ValueError, match="70 blocks over its 2 KV cache groups"):
        make_llm(gemma2_dir, release=True, num_kv_blocks=70)
    with caplog.at_level(logging.INFO, logger="chassis"):
        llm = make_llm(gemma2_dir, release=True, num_kv_blocks=71)
    assert llm.engine.info.num_kv_blocks == 70
    # the logged token capacity: a position takes a block in each of the 2 groups
    assert "KV cache: 71 blocks of 4 tokens (140 tokens)" in caplog.text
    assert "KV cache 70 blocks (140 tokens)" in caplog.text


def test_async_scheduling_and_ngram_speculation_keep_outputs(
    gemma2_dir: Path, gemma2_expected: list[list[int]]
) -> None:
    tokens, _ = run(make_llm(gemma2_dir, release=True, async_scheduling=True), PROMPTS)
    assert tokens == gemma2_expected
    prompts = ["1 2 3 1 2 3 1 2 3 1 2 3 1 2 3 1 2", *PROMPTS[:2]]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = make_llm(gemma2_dir, release=True, speculative_config=spec)
    tokens, _ = run(llm, prompts, 16)
    assert tokens == gemma_hf_greedy(gemma2_dir, prompts, 16)
    assert llm.engine.scheduler.spec_num_draft_tokens > 0


def test_a_draft_model_reads_the_groups_that_keep_its_context_and_keeps_outputs(
    gemma2_dir: Path, gemma2_expected: list[list[int]]
) -> None:
    # the draft (here the model itself) puts its window layers on the target's window
    # group and its full layers on the full group: two cache tensors for four layers, every
    # block id used by one draft layer per tensor; the target's window group still releases
    spec = {"model": str(gemma2_dir), "num_speculative_tokens": 3}
    llm = make_llm(gemma2_dir, release=True, speculative_config=spec)
    kv = llm.engine.kv_cache_manager
    assert kv.group_windows == [None, 4]
    drafter = llm.engine.executor.worker.runner.drafter
    assert drafter.layer_group == [1, 0, 1, 0]
    assert drafter.num_cache_tensors() == 2
    assert len({c.data_ptr() for c in drafter.kv_caches}) == 2
    tokens, most_held = run(llm, PROMPTS)
    assert tokens == gemma2_expected
    # the draft is the target: a draft layer reading a wrong or released block would make
    # it disagree, and a rejected draft would show here
    scheduler = llm.engine.scheduler
    assert scheduler.spec_num_accepted_tokens == scheduler.spec_num_draft_tokens > 0
    off = make_llm(gemma2_dir, release=False, speculative_config=spec)
    kept, most_kept = run(off, PROMPTS)
    assert kept == gemma2_expected
    assert layer_blocks(llm, most_held) < layer_blocks(off, most_kept)


def test_gpt_oss_equals_the_reference(tmp_path: Path) -> None:
    from test_gpt_oss import write_tiny_gpt_oss

    model_dir = write_tiny_gpt_oss(tmp_path / "gpt_oss", num_hidden_layers=4)
    on, off = make_llm(model_dir, release=True), make_llm(model_dir, release=False)
    assert on.engine.kv_cache_manager.group_windows == [None, 4]
    released, most_released = run(on, PROMPTS)
    kept, most_kept = run(off, PROMPTS)
    assert released == kept
    assert layer_blocks(on, most_released) < layer_blocks(off, most_kept)


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_ranks_keep_outputs(gemma2_dir: Path, gemma2_expected: list[list[int]]) -> None:
    llm = make_llm(gemma2_dir, release=True, tensor_parallel_size=2)
    try:
        assert llm.engine.kv_cache_manager.group_windows == [None, 4]
        tokens, _ = run(llm, PROMPTS)
    finally:
        llm.shutdown()
    assert tokens == gemma2_expected


def test_torch_compile_gives_each_layer_its_groups_metadata(
    gemma2_dir: Path, gemma2_expected: list[list[int]]
) -> None:
    # the compiled forward's opaque attention op looks the layer's group up the same way
    llm = make_llm(gemma2_dir, release=True, torch_compile=True)
    assert llm.engine.kv_cache_manager.group_windows == [None, 4]
    tokens, _ = run(llm, PROMPTS)
    assert tokens == gemma2_expected
