"""BlockPool: free list in LRU order, reference counts, prefix-cache map and eviction."""

from __future__ import annotations

import pytest

from chassis.core.block_pool import BlockPool


def test_new_pool_is_all_free_and_hands_out_blocks_in_order() -> None:
    pool = BlockPool(4)
    assert pool.num_free_blocks == 4
    assert pool.usage == 0.0
    assert pool.get_new_blocks(3) == [0, 1, 2]
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert pool.num_used_blocks == 3
    assert pool.usage == 0.75


def test_allocating_more_than_free_raises_and_takes_nothing() -> None:
    pool = BlockPool(2)
    pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="only 1 of 2 are free"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1


def test_invalid_sizes_raise() -> None:
    with pytest.raises(ValueError, match="at least 1 block"):
        BlockPool(0)
    with pytest.raises(ValueError, match=">= 0"):
        BlockPool(2).get_new_blocks(-1)


def test_freed_blocks_are_reused_oldest_freed_first() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks([blocks[2]])
    pool.free_blocks([blocks[0], blocks[3]])
    assert pool.num_free_blocks == 3
    assert pool.get_new_blocks(3) == [2, 0, 3]


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([block])


def test_shared_block_is_free_only_after_last_reference() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert pool.ref_count(block) == 2
    pool.free_blocks([block])
    assert not pool.is_free(block)
    pool.free_blocks([block])
    assert pool.is_free(block)
    assert pool.num_free_blocks == 2


def test_cached_block_survives_free_and_is_hit_by_touch() -> None:
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    assert pool.cache_block(block, b"h0")
    pool.free_blocks([block])
    # Still a hit while free: touching takes it off the free list again.
    assert pool.get_cached_block(b"h0") == block
    pool.touch([block])
    assert pool.ref_count(block) == 1
    assert pool.num_free_blocks == 2
    assert pool.block_hash(block) == b"h0"


def test_reallocating_a_cached_block_evicts_its_hash() -> None:
    pool = BlockPool(2)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, b"a")
    pool.cache_block(second, b"b")
    pool.free_blocks([second, first])  # second freed first: evicted first
    assert pool.get_new_blocks(1) == [second]
    assert pool.get_cached_block(b"b") is None
    assert pool.block_hash(second) is None
    assert pool.get_cached_block(b"a") == first
    assert pool.num_cached_blocks == 1


def test_cache_block_keeps_first_block_for_a_hash_and_first_hash_for_a_block() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, b"h")
    assert not pool.cache_block(b, b"h")
    assert pool.get_cached_block(b"h") == a
    assert pool.block_hash(b) is None
    assert not pool.cache_block(a, b"other")
    assert pool.block_hash(a) == b"h"


def test_cache_block_rejects_free_blocks() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="is free"):
        pool.cache_block(0, b"h")


def test_uncache_and_reset_prefix_cache() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"a")
    pool.cache_block(b, b"b")
    pool.uncache_block(a)
    assert pool.get_cached_block(b"a") is None
    assert pool.reset_prefix_cache() == 1
    assert pool.get_cached_block(b"b") is None
    assert pool.block_hash(b) is None
    # Owners are unaffected.
    assert pool.ref_count(a) == pool.ref_count(b) == 1
