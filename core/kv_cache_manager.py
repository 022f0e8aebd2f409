"""``KVCacheManager``: which KV blocks each request owns, and the prefix cache.

Schedulers talk to the KV cache only through this class:

1. a request enters: ``blocks, num_hit = get_computed_blocks(request)`` finds the longest cached
   prefix of full blocks;
2. every step it is scheduled: ``allocate_slots(request, num_new_tokens, ...)`` makes room for
   the tokens it will compute (``None``: no room, nothing changed; preempt or wait);
3. it finishes or is preempted: ``free(request)``.

Prefix caching. A *full* block is keyed by a chained hash: ``hash(parent_hash, its token ids)``,
so equal keys mean equal whole prefixes, not just equal blocks. A block is registered once its
K/V have been computed, i.e. once ``request.num_computed_tokens`` covers it, checked on the
request's next ``allocate_slots`` and on ``free``. Registering a block only after it was computed
(rather than when it is scheduled) means no request can ever hit a block whose K/V do not exist
yet, even if its owner is preempted in the step that scheduled it. The cost is that two
requests with the same prefix scheduled in the *same* step do not share it.

Sliding window. Built with ``sliding_window=W`` (every attention layer of the model, and of
a draft model, sees at most the last ``W`` positions, its own included), the manager releases
the blocks a request's window has left: a step that computes from position ``c`` on (and every
later step) reads no key before ``c - W + 1``, so in :meth:`allocate_slots` every leading
block wholly before that position goes back to the pool (registered in the prefix cache first,
so it stays a hit until evicted, like any free cached block) and its block-table entry becomes
the pool's reserved null block :data:`~chassis.core.block_pool.NULL_BLOCK_ID`. A request then
holds about ``(W + tokens of its step) / block_size`` blocks whatever its length. Prefix-cache
hits need only the blocks the window of the first computed position reads: the hit is the
longest cached prefix whose last ``W - 1`` positions (and the blocks holding them) are cached,
with null entries before them.

Units: every count is in tokens unless its name says blocks.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chassis.core.block_pool import NULL_BLOCK_ID, BlockHash, BlockPool

if TYPE_CHECKING:
    from chassis.core.config import EngineConfig
    from chassis.core.request import Request


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The prefix-cache key of a full block: sha256 of the parent's key and the token ids.

    Stable across processes and runs (no Python ``hash`` randomization).
    """
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


def prefix_cache_seed(request: Request) -> BlockHash | None:
    """What a request's first block hash chains from: ``None``, or a key of the request's
    LoRA adapter and of its ``cache_salt``, so that K/V computed with one adapter (or none)
    is never reused for another, and a salted request shares cached blocks only with
    requests of the same salt."""
    lora_id = request.lora_int_id
    salt = request.cache_salt
    if not lora_id and salt is None:
        return None
    digest = hashlib.sha256(b"lora:%d" % lora_id)
    if salt is not None:
        digest.update(b"\0salt:" + salt.encode())
    return digest.digest()


def max_tokens_per_step(config: EngineConfig) -> int:
    """The most KV slots one request is given in one ``allocate_slots`` call by the built-in
    schedulers: the step's tokens (drafts included) are at most ``max_num_batched_tokens``,
    and a draft model's lookahead adds up to ``num_speculative_tokens`` slots."""
    spec = config.speculative
    lookahead = spec.num_speculative_tokens if spec is not None and spec.uses_draft_model else 0
    return config.max_num_batched_tokens + lookahead


def max_blocks_per_request(
    max_model_len: int, block_size: int, sliding_window: int | None, step_tokens: int
) -> int:
    """The most blocks one request of at most ``max_model_len`` tokens holds, given at most
    ``step_tokens`` slots per ``allocate_slots`` call: every block of its longest context,
    or, with ``sliding_window=W`` (release on), those of positions ``c - W + 1`` to
    ``c + n - 1`` for a step of ``n`` tokens from ``c``: ``W + n - 1`` positions, which
    cover at most ``ceil((W + n + block_size - 2) / block_size)`` blocks (when the first of
    them is the last of its block). The reserved null block is not counted."""
    whole = -(-max_model_len // block_size)
    if sliding_window is None:
        return whole
    return min(whole, -(-(sliding_window + step_tokens + block_size - 2) // block_size))


@dataclass
class _RequestBlocks:
    """What the manager keeps per request."""

    block_ids: list[int] = field(default_factory=list)
    #: chained hashes of the request's first full blocks (computed lazily, only ever extended)
    block_hashes: list[BlockHash] = field(default_factory=list)
    #: leading blocks already registered in (or hit from) the prefix cache
    num_cached_blocks: int = 0
    #: leading block-table entries that are the null block (released: out of the window)
    num_null_blocks: int = 0


class KVCacheManager:
    """Allocates KV blocks to requests, with prefix caching (on by default).

    :param num_blocks: blocks in every layer's KV cache tensor.
    :param block_size: tokens per block.
    :param enable_prefix_caching: share full blocks between requests with equal prefixes.
        When off, nothing is hashed and :meth:`get_computed_blocks` never hits.
    :param sliding_window: ``None``, or the window ``W`` that bounds what *every* attention
        layer reads (the module docstring): blocks before a request's window are released and
        the pool reserves block :data:`~chassis.core.block_pool.NULL_BLOCK_ID` for their
        block-table entries (``num_blocks - 1`` usable blocks).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1; got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None; got {sliding_window}")
        self.block_pool = BlockPool(num_blocks, reserve_null_block=sliding_window is not None)
        #: blocks of the KV cache tensors (the null block included when reserved)
        self.num_blocks = num_blocks
        #: blocks requests can hold (``num_blocks`` less the null block)
        self.num_usable_blocks = self.block_pool.num_usable_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        #: tokens looked up in the prefix cache (each call of get_computed_blocks counts)
        self.prefix_cache_queries = 0
        #: of those, tokens found
        self.prefix_cache_hits = 0
        self._requests: dict[str, _RequestBlocks] = {}

    # -- queries ---------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests, in ``[0, 1]`` (cached free blocks are unused)."""
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to :meth:`allocate_slots` (free cached blocks included)."""
        return self.block_pool.num_free_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table (empty if it holds no blocks); released entries
        are :data:`~chassis.core.block_pool.NULL_BLOCK_ID`."""
        state = self._requests.get(request_id)
        return list(state.block_ids) if state else []

    def num_null_blocks(self, request_id: str) -> int:
        """How many leading entries of the request's block table are the null block (blocks
        released because its sliding window left them; 0 without a window)."""
        state = self._requests.get(request_id)
        return state.num_null_blocks if state else 0

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds a reference to (its block table less the null entries)."""
        state = self._requests.get(request_id)
        return len(state.block_ids) - state.num_null_blocks if state else 0

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    # -- prefix cache ----------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of full blocks of ``request.all_token_ids``.

        Returns ``(block_ids, num_computed_tokens)`` with ``num_computed_tokens ==
        len(block_ids) * block_size``. Pass both to :meth:`allocate_slots` in the same step
        (nothing is reserved until then). The whole sequence is never returned: at least one
        token is left to compute so that the step produces logits. Only for a request that
        holds no blocks (new, or resumed after preemption). Adds ``request.num_tokens`` to
        :attr:`prefix_cache_queries` and the hit tokens to :attr:`prefix_cache_hits`.

        A request that asks for ``prompt_logprobs`` never hits (and is not counted): its
        prompt logprobs need the logits of every prompt position, so it computes them all.

        With a sliding window the prefix need not be cached from its start: a hit of ``k``
        blocks needs only the blocks holding positions ``k * block_size - W + 1 ..`` (what
        the first computed position's window reads); ``block_ids`` has the null block before
        them, and the longest such ``k`` is returned.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestBlocks()
        elif state.block_ids:
            raise ValueError(
                f"request {request.request_id!r} already holds KV blocks; "
                "get_computed_blocks is for requests without blocks"
            )
        num_tokens = request.num_tokens
        max_hit_blocks = (num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, state, max_hit_blocks)
        if self.sliding_window is None:
            hit_blocks: list[int] = []
            for block_hash in hashes[:max_hit_blocks]:
                block_id = self.block_pool.get_cached_block(block_hash)
                if block_id is None:
                    break
                hit_blocks.append(block_id)
        else:
            hit_blocks = self._window_hit(hashes[:max_hit_blocks])
        num_hit_tokens = len(hit_blocks) * self.block_size
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return hit_blocks, num_hit_tokens

    def _window_hit(self, hashes: list[BlockHash]) -> list[int]:
        """The longest window-valid hit over ``hashes`` (see :meth:`get_computed_blocks`):
        block ids with the null block before the blocks the window needs."""
        assert self.sliding_window is not None
        size = self.block_size
        found = [self.block_pool.get_cached_block(h) for h in hashes]
        # run_start[i]: the first block of the run of cached blocks that ends at block i
        run_start = [0] * len(found)
        for i, block_id in enumerate(found):
            if block_id is not None:
                run_start[i] = run_start[i - 1] if i and found[i - 1] is not None else i
        # a hit of k blocks needs blocks first..k-1 cached, first holding the first key the
        # next query (position k * size) reads: k * size - W + 1
        for k in range(len(found), 0, -1):
            first = max(0, k * size - self.sliding_window + 1) // size
            if found[k - 1] is not None and run_start[k - 1] <= first:
                needed = [b for b in found[first:k] if b is not None]
                return [NULL_BLOCK_ID] * first + needed
        return []

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (contents of blocks in use are untouched); returns how many
        hashes were dropped. Blocks already registered for running requests are not registered
        again."""
        return self.block_pool.reset_prefix_cache()

    # -- allocation ------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for ``request`` to compute ``num_new_tokens`` more tokens.

        After the call the request holds blocks for ``request.num_computed_tokens +
        num_new_computed_tokens + num_new_tokens`` tokens. ``new_computed_blocks`` and
        ``num_new_computed_tokens`` are the result of :meth:`get_computed_blocks` for a request
        that holds no blocks yet: those blocks get a reference and start its block table. The
        caller then adds ``num_new_computed_tokens`` to ``request.num_computed_tokens``.

        Also registers in the prefix cache every full block that ``request.num_computed_tokens``
        (plus the hits) now covers.

        With a sliding window, first releases the blocks that the window of position
        ``request.num_computed_tokens`` (this step's first) has left: they count as free for
        this call, and they stay released even when it returns ``None`` (no step reads them
        again); :meth:`num_null_blocks` says how many leading entries are then the null block.

        Returns the block ids newly taken from the free list (possibly empty), in block-table
        order after the existing ones; or ``None`` if there are not enough free blocks, in which
        case nothing else changed.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0; got {num_new_tokens}")
        state = self._requests.get(request.request_id)
        num_free_hits = 0
        if new_computed_blocks or num_new_computed_tokens:  # prefix-cache hits: check them
            self._check_hits(request, state, new_computed_blocks, num_new_computed_tokens)
            # Hits sitting in the free list leave it when touched, so they count against it.
            # (the null block, where a window needs none, is never free)
            num_free_hits = sum(1 for b in new_computed_blocks if self.block_pool.ref_count(b) == 0)
        elif state is not None and self.sliding_window is not None:
            self._release_out_of_window(request, state)
        num_held = len(state.block_ids) if state else 0
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = self.num_blocks_for(num_computed + num_new_tokens)
        num_to_take = max(0, num_required - num_held - len(new_computed_blocks))
        if num_to_take + num_free_hits > self.block_pool.num_free_blocks:
            return None

        if state is None:
            state = self._requests[request.request_id] = _RequestBlocks()
        if new_computed_blocks:
            # a window hit's leading entries are the null block (without a window, block
            # NULL_BLOCK_ID is an ordinary block)
            num_null = 0
            if self.sliding_window is not None:
                while (
                    num_null < len(new_computed_blocks)
                    and new_computed_blocks[num_null] == NULL_BLOCK_ID
                ):
                    num_null += 1
            self.block_pool.touch(new_computed_blocks[num_null:])
            state.block_ids.extend(new_computed_blocks)
            state.num_cached_blocks = len(new_computed_blocks)
            state.num_null_blocks = num_null
        new_blocks = self.block_pool.get_new_blocks(num_to_take) if num_to_take else []
        state.block_ids.extend(new_blocks)
        self._cache_computed_blocks(request, state, num_computed)
        return new_blocks

    def _check_hits(
        self,
        request: Request,
        state: _RequestBlocks | None,
        new_computed_blocks: Sequence[int],
        num_new_computed_tokens: int,
    ) -> None:
        """``allocate_slots``'s rules for prefix-cache hits (``ValueError`` when broken)."""
        if num_new_computed_tokens != len(new_computed_blocks) * self.block_size:
            raise ValueError(
                f"num_new_computed_tokens ({num_new_computed_tokens}) must be "
                f"len(new_computed_blocks) * block_size "
                f"({len(new_computed_blocks)} * {self.block_size})"
            )
        if (state is not None and state.block_ids) or request.num_computed_tokens:
            raise ValueError(
                f"request {request.request_id!r}: prefix-cache blocks can only start a request "
                "that holds no blocks and has no computed tokens"
            )

    def free(self, request: Request) -> None:
        """Release the request's blocks; those also used by others or cached stay valid.

        Blocks covered by ``request.num_computed_tokens`` are registered in the prefix cache
        first, so call this *before* resetting ``num_computed_tokens`` (preemption), and only
        with a count of tokens whose K/V were actually computed or are being computed by a step
        already sent to the runner. Blocks are released tail first, so the request's last
        blocks are evicted before its first ones. A request without blocks is a no-op.
        """
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return
        self._cache_computed_blocks(request, state, request.num_computed_tokens)
        self.block_pool.free_blocks(reversed(state.block_ids[state.num_null_blocks :]))

    def _release_out_of_window(self, request: Request, state: _RequestBlocks) -> None:
        """Release the leading blocks wholly before the window of position
        ``request.num_computed_tokens`` (registered in the prefix cache first) and put the
        null block in their entries."""
        assert self.sliding_window is not None
        first_key = request.num_computed_tokens - self.sliding_window + 1
        num_out = min(max(first_key, 0) // self.block_size, len(state.block_ids))
        if num_out <= state.num_null_blocks:
            return  # (most steps: the window has not left another block)
        self._cache_computed_blocks(request, state, request.num_computed_tokens)
        released = state.block_ids[state.num_null_blocks : num_out]
        state.block_ids[state.num_null_blocks : num_out] = [NULL_BLOCK_ID] * len(released)
        state.num_null_blocks = num_out
        self.block_pool.free_blocks(released)

    # -- internals -------------------------------------------------------------------------

    def _block_hashes(
        self, request: Request, state: _RequestBlocks, num_blocks: int
    ) -> list[BlockHash]:
        """The request's chained block hashes, extended to at least ``num_blocks`` entries."""
        hashes = state.block_hashes
        if len(hashes) < num_blocks:
            tokens = request.all_token_ids
            size = self.block_size
            for i in range(len(hashes), num_blocks):
                parent = hashes[-1] if hashes else prefix_cache_seed(request)
                hashes.append(hash_block_tokens(parent, tokens[i * size : (i + 1) * size]))
        return hashes

    def _cache_computed_blocks(
        self, request: Request, state: _RequestBlocks, num_computed_tokens: int
    ) -> None:
        """Register the request's full blocks whose K/V cover ``num_computed_tokens``."""
        if (
            not self.enable_prefix_caching
            or num_computed_tokens // self.block_size <= state.num_cached_blocks
        ):
            return  # (the second test: no block completed since the last call, most steps)
        # Under async scheduling the count may include positions whose token ids are still in
        # flight; a block is keyed by its token ids, so only known tokens can complete one.
        num_known = min(num_computed_tokens, request.num_tokens)
        num_full = min(num_known // self.block_size, len(state.block_ids))
        if num_full <= state.num_cached_blocks:
            return
        hashes = self._block_hashes(request, state, num_full)
        for i in range(max(state.num_cached_blocks, state.num_null_blocks), num_full):
            self.block_pool.cache_block(state.block_ids[i], hashes[i])
        state.num_cached_blocks = num_full
