"""KVCacheManager: slot allocation, prefix-cache lookups, registration, freeing and counters."""

from __future__ import annotations

import pytest

from chassis.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from chassis.core.request import Request
from chassis.core.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=8))


def compute(kv: KVCacheManager, request: Request, num_tokens: int) -> list[int] | None:
    """What a scheduler does for one step: allocate, then count the tokens as computed."""
    blocks = kv.allocate_slots(request, num_tokens)
    if blocks is not None:
        request.num_computed_tokens += num_tokens
    return blocks


def admit(kv: KVCacheManager, request: Request, num_tokens: int | None = None) -> list[int]:
    """First scheduling: look up the prefix cache, allocate, and count hits and new tokens."""
    hits, num_hit = kv.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit if num_tokens is None else num_tokens
    blocks = kv.allocate_slots(request, num_new, hits, num_hit)
    assert blocks is not None
    request.num_computed_tokens = num_hit + num_new
    return blocks


def test_hash_is_chained_and_stable() -> None:
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(h1, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert isinstance(h1, bytes) and len(h1) == 32


def test_allocate_slots_grows_block_table_on_demand() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("a", list(range(6)))
    assert compute(kv, request, 6) == [0, 1]
    assert kv.get_block_ids("a") == [0, 1]
    request.output_token_ids.append(100)
    assert compute(kv, request, 1) == []  # position 6 still fits in block 1
    request.output_token_ids.append(101)
    assert compute(kv, request, 1) == []
    request.output_token_ids.append(102)
    assert compute(kv, request, 1) == [2]  # position 8 opens block 2
    assert kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(3 / 8)


def test_allocate_slots_returns_none_and_changes_nothing_when_full() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", list(range(8)))
    assert compute(kv, a, 8) is not None
    b = make_request("b", list(range(100, 108)))
    assert kv.allocate_slots(b, 8) is None
    assert kv.get_block_ids("b") == []
    assert kv.num_free_blocks == 1


def test_allocate_slots_validates_arguments() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    request = make_request("a", list(range(8)))
    with pytest.raises(ValueError, match="num_new_tokens"):
        kv.allocate_slots(request, -1)
    with pytest.raises(ValueError, match="num_new_computed_tokens"):
        kv.allocate_slots(request, 1, [0], 3)
    compute(kv, request, 4)
    with pytest.raises(ValueError, match="holds no blocks"):
        kv.allocate_slots(request, 1, [1], 4)


def test_full_computed_blocks_are_shared_by_a_later_request() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(10)))
    admit(kv, a)
    a.output_token_ids.append(7)
    compute(kv, a, 1)  # the next allocation registers a's computed full blocks
    b = make_request("b", [*range(8), 50, 51, 52])
    hits, num_hit = kv.get_computed_blocks(b)
    assert hits == kv.get_block_ids("a")[:2]
    assert num_hit == 8
    new = kv.allocate_slots(b, b.num_tokens - num_hit, hits, num_hit)
    assert new is not None and len(new) == 1
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    assert [kv.block_pool.ref_count(x) for x in hits] == [2, 2]
    assert kv.prefix_cache_queries == 10 + 11  # a's lookup (a miss) and b's
    assert kv.prefix_cache_hits == 8


def test_blocks_are_registered_only_once_computed() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)  # scheduled, not yet computed
    b = make_request("b", [*range(8), 9])
    assert kv.get_computed_blocks(b) == ([], 0)


def test_free_registers_computed_blocks_and_keeps_them_as_hits() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    a_blocks = kv.get_block_ids("a")
    kv.free(a)
    assert kv.num_free_blocks == 4
    assert kv.usage == 0.0
    b = make_request("b", list(range(9)))
    hits, num_hit = kv.get_computed_blocks(b)
    assert hits == a_blocks[:2] and num_hit == 8


def test_whole_sequence_is_never_a_hit() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    same = make_request("b", list(range(8)))
    hits, num_hit = kv.get_computed_blocks(same)
    assert num_hit == 4 and len(hits) == 1  # the last token must be computed for logits


def test_free_releases_tail_first_so_prefix_blocks_survive_longest() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = make_request("a", list(range(6)))
    admit(kv, a)
    *_, third = kv.get_block_ids("a")
    kv.free(a)
    c = make_request("c", [90, 91])
    assert kv.allocate_slots(c, 2) == [third]


def test_shared_blocks_stay_in_use_until_every_owner_frees() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    b = make_request("b", list(range(9)))
    c = make_request("c", [*range(8), 77])
    admit(kv, b)
    admit(kv, c)
    shared = kv.get_block_ids("b")[:2]
    assert kv.get_block_ids("c")[:2] == shared
    kv.free(b)
    assert all(kv.block_pool.ref_count(x) == 1 for x in shared)
    kv.free(c)
    assert kv.num_free_blocks == 6


def test_hits_are_lost_once_evicted() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = make_request("a", list(range(5)))
    admit(kv, a)
    kv.free(a)
    other = make_request("o", list(range(100, 108)))
    assert kv.allocate_slots(other, 8) is not None  # takes both blocks: evicts a's
    kv.free(other)
    b = make_request("b", list(range(5)))
    hits, _ = kv.get_computed_blocks(b)
    assert hits == []


def test_free_hits_count_against_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", list(range(9)))
    admit(kv, a)  # 3 blocks
    kv.free(a)  # blocks 0, 1 cached and free
    b = make_request("b", [*range(8), *range(200, 209)])  # 2 hit blocks + 9 new tokens
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    # 9 new tokens need 3 more blocks, the 2 hits take 2 of the 3 free ones: no room.
    assert kv.allocate_slots(b, 9, hits, num_hit) is None
    assert kv.num_free_blocks == 3
    assert kv.allocate_slots(b, 4, hits, num_hit) is not None


def test_prefix_caching_disabled_never_hashes_or_hits() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    assert kv.block_pool.num_cached_blocks == 0
    b = make_request("b", list(range(9)))
    assert kv.get_computed_blocks(b) == ([], 0)
    assert kv.prefix_cache_queries == kv.prefix_cache_hits == 0


def test_reset_prefix_cache_forgets_hits() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    assert kv.reset_prefix_cache() == 2
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)


def test_resumed_request_hits_its_own_prompt_and_outputs() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(6)))
    admit(kv, a)
    for token in (60, 61, 62):
        a.output_token_ids.append(token)
        compute(kv, a, 1)
    a.output_token_ids.append(63)  # sampled, not yet computed
    # Preemption: free first (registers what is computed), then reset.
    kv.free(a)
    a.num_computed_tokens = 0
    hits, num_hit = kv.get_computed_blocks(a)
    assert num_hit == 8  # 9 of 10 tokens computed -> 2 full blocks
    assert len(hits) == 2


def test_free_of_unknown_request_is_a_noop() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    kv.free(make_request("x", [1]))
    assert kv.num_free_blocks == 2


def test_get_computed_blocks_rejects_request_with_blocks() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = make_request("a", list(range(5)))
    compute(kv, a, 5)
    with pytest.raises(ValueError, match="already holds"):
        kv.get_computed_blocks(a)
