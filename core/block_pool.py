"""``BlockPool``: the KV cache blocks, their reference counts, free list and prefix-cache map.

A block is an index into every layer's KV cache tensor. The pool knows nothing about requests
or tokens; :class:`chassis.core.kv_cache_manager.KVCacheManager` builds on it.

Life of a block:

* free, no hash: in the free list, never used or its content is worthless;
* in use (``ref_count >= 1``): owned by one request, or shared by several through the prefix
  cache;
* free with a hash: its owners finished but its K/V are still valid. It stays in the free list
  *and* in the hash map: a later request with the same prefix can :meth:`touch` it back (a
  prefix-cache hit), while :meth:`get_new_blocks` may evict it, which drops its hash.

The free list is in LRU order: blocks are appended when their last reference goes and taken
from the front, so the blocks freed longest ago are evicted first.

The null block. A pool built with ``reserve_null_block=True`` keeps block
:data:`NULL_BLOCK_ID` out of circulation: it is never handed out, freed or cached, so nothing
ever writes it and it keeps the zeros the caches are allocated with. A block table puts it
where a request's block was released because no layer reads those positions any more (a
sliding window, ``KVCacheManager``); a kernel that still reads such a slot, and masks it,
reads finite zeros.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

#: An opaque, content-derived key of a full block (see ``kv_cache_manager.hash_block_tokens``).
BlockHash = bytes

#: The block id a block table holds where its request's block was released (see the module
#: docstring); only reserved in pools built with ``reserve_null_block=True``.
NULL_BLOCK_ID = 0


class BlockPool:
    """A fixed set of ``num_blocks`` KV blocks with reference counts and a prefix-cache map.

    With ``reserve_null_block`` block :data:`NULL_BLOCK_ID` is kept out of circulation (the
    module docstring), so ``num_blocks - 1`` blocks are usable. Not thread-safe: the engine
    core loop is its only user.
    """

    def __init__(self, num_blocks: int, reserve_null_block: bool = False) -> None:
        num_reserved = 1 if reserve_null_block else 0
        if num_blocks < 1 + num_reserved:
            raise ValueError(
                f"a block pool needs at least {1 + num_reserved} block(s)"
                f"{' (one is the null block)' if num_reserved else ''}; got num_blocks={num_blocks}"
            )
        self.num_blocks = num_blocks
        #: blocks that can ever be handed out (``num_blocks`` less the null block)
        self.num_usable_blocks = num_blocks - num_reserved
        self._ref_counts = [0] * num_blocks
        self._hashes: list[BlockHash | None] = [None] * num_blocks
        # block id -> None, oldest-freed first (an ordered set with O(1) removal)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_reserved, num_blocks))
        self._cached: dict[BlockHash, int] = {}
        #: whether NULL_BLOCK_ID is reserved (then touching, freeing or caching it is an error)
        self.has_null_block = reserve_null_block
        if reserve_null_block:
            self._ref_counts[NULL_BLOCK_ID] = 1  # never reaches 0: never in the free list

    # -- sizes -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that :meth:`get_new_blocks` can hand out (cached-but-free ones included)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with at least one reference (the null block not counted)."""
        return self.num_usable_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks in use, in ``[0, 1]``."""
        return self.num_used_blocks / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix-cache map (in use or free)."""
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        """How many owners ``block_id`` has (0: it is free)."""
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The hash ``block_id`` is registered under, or ``None``."""
        return self._hashes[block_id]

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    # -- allocation ------------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the front of the free list, each with one reference.

        A taken block that was still registered in the prefix cache is evicted: its hash is
        dropped. Raises ``ValueError`` if fewer than ``num_blocks`` are free (nothing is taken).
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0; got {num_blocks}")
        if num_blocks > len(self._free):
            raise ValueError(
                f"cannot allocate {num_blocks} KV blocks: only {len(self._free)} of "
                f"{self.num_blocks} are free"
            )
        blocks = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self._ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block, taking free ones (prefix-cache hits) off the free list.

        The caller must check beforehand that it may take the free ones (they count against
        :attr:`num_free_blocks`).
        """
        for block_id in block_ids:
            self._check_not_null(block_id)
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; a block whose last reference goes joins the end
        of the free list, keeping its hash (it stays a cache hit until evicted).

        Pass a request's blocks tail first, so its last blocks are evicted before its first
        ones (the first are the likeliest to be shared by a later request).
        Raises ``ValueError`` on a block that is already free.
        """
        for block_id in block_ids:
            self._check_not_null(block_id)
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"KV block {block_id} is freed more often than it was taken")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None

    # -- prefix cache ----------------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """The block registered under ``block_hash`` (in use or free), or ``None``."""
        return self._cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register ``block_id`` (in use, full, K/V computed) under ``block_hash``.

        Returns whether it was registered: a block that already has a hash keeps it, and a
        hash already held by another block keeps that block (the duplicate stays private to its
        owner and is reused as an ordinary block once freed).
        """
        self._check_not_null(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"KV block {block_id} is free; only blocks in use can be cached")
        if self._hashes[block_id] is not None or block_hash in self._cached:
            return False
        self._hashes[block_id] = block_hash
        self._cached[block_hash] = block_id
        return True

    def uncache_block(self, block_id: int) -> None:
        """Drop ``block_id``'s hash, if any (its K/V are no longer to be trusted)."""
        self._evict(block_id)

    def reset_prefix_cache(self) -> int:
        """Forget every hash (blocks in use keep their contents and owners); returns how many."""
        num = len(self._cached)
        self._cached.clear()
        self._hashes = [None] * self.num_blocks
        return num

    def _check_not_null(self, block_id: int) -> None:
        if self.has_null_block and block_id == NULL_BLOCK_ID:
            raise ValueError(
                f"KV block {NULL_BLOCK_ID} is the reserved null block: it is never taken, "
                "freed or cached"
            )

    def _evict(self, block_id: int) -> None:
        block_hash = self._hashes[block_id]
        if block_hash is not None:
            self._hashes[block_id] = None
            if self._cached.get(block_hash) == block_id:
                del self._cached[block_hash]
