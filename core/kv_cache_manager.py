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
requests with the same prefix scheduled in the *same* step do not share it. A block that covers
any placeholder token of an image (:mod:`chassis.core.multimodal`) also hashes the image's
content identifier and where the image starts relative to the block: every image's
placeholder tokens are the same ids, so the ids alone would let two images share K/V.

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

KV cache groups. Built with ``group_windows`` (one entry per group of attention layers that
read the same window, ``None`` for full attention: docs/architecture.md, "KV cache per group
of layers"), a request has one block table per group, every group's blocks come from the
one pool, and a block id names a slot of its own group's layers only. :meth:`allocate_group_slots`
gives every group blocks for the same tokens (all or none), and releases behind the window
only in window groups; prefix-cache keys are ``(group, block hash)`` (group 0's key is the
bare hash), and a hit is the longest prefix that every group can serve (full groups need
every block of it, window groups only the blocks their window reads). With one group the
manager is the single-table one above: ``sliding_window=W`` is ``group_windows=[W]``.

Chunk groups. ``group_chunks`` (one entry per group, ``None`` or the chunk size ``C`` of a
group of chunked local-attention layers, Llama 4's RoPE layers, whose window is ``None``)
makes a group release like a window group, by its own rule: a query at ``p`` reads positions
``floor(p / C) * C .. p``, so a step that computes from ``c`` on (and every later step) reads
no key before the start of ``c``'s chunk, and every block wholly before it is released (null
entries, as above). A prefix-cache hit of ``k`` blocks needs, in a chunk group, only the
blocks from the one holding the start of the chunk of position ``k * block_size`` (the next
query) to block ``k - 1``, every one of them cached: the next query and the rest of its chunk
read those keys and no earlier ones, and later chunks read only keys they compute themselves
(none at all when ``k * block_size`` starts a chunk). A request holds at most a chunk less
one position plus its step, the bound of a window of ``C`` (:func:`max_blocks_per_request`).

Units: every count is in tokens unless its name says blocks.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chassis.core.block_pool import NULL_BLOCK_ID, BlockHash, BlockPool
from chassis.core.kv_cache_groups import single_group_window
from chassis.core.prompt_embeds import embeds_block_keys

if TYPE_CHECKING:
    from chassis.core.config import EngineConfig
    from chassis.core.multimodal import MultiModalFeature
    from chassis.core.request import Request


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b""
) -> BlockHash:
    """The prefix-cache key of a full block: sha256 of the parent's key, the token ids and
    ``extra_keys`` (what else the block's K/V depend on: :func:`multimodal_block_keys`;
    empty for text, whose keys are then those of the token ids alone).

    Stable across processes and runs (no Python ``hash`` randomization).
    """
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        digest.update(extra_keys)
    return digest.digest()


def multimodal_block_keys(features: Sequence[MultiModalFeature], start: int, end: int) -> bytes:
    """The extra key of the block of token positions ``start .. end - 1``: for each
    multimodal item whose placeholder tokens it covers, the item's content identifier and
    its first placeholder's position relative to ``start`` (which part of the item the block
    holds); ``b""`` when it covers none. ``features`` are in prompt order."""
    keys = b""
    for feature in features:
        if feature.offset >= end:
            break  # (prompt order: the later ones start later still)
        if feature.offset + feature.length > start:
            keys += b"\0mm:%s@%d" % (feature.identifier.encode(), feature.offset - start)
    return keys


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


def max_group_blocks_per_request(
    max_model_len: int,
    block_size: int,
    group_windows: Sequence[int | None],
    step_tokens: int,
    group_chunks: Sequence[int | None] = (),
) -> int:
    """The most blocks one request holds across its KV cache groups (:func:`max_blocks_per_request`
    of each group's window, summed: the groups share one pool). ``group_chunks`` (empty: no
    chunk groups) gives each chunk group's chunk size ``C``; such a group holds the positions
    from its current chunk's start (at most ``C - 1`` before the step's first) to the step's
    last, at most what a window of ``C`` holds."""
    chunks = list(group_chunks) or [None] * len(group_windows)
    return sum(
        max_blocks_per_request(
            max_model_len, block_size, window if chunk is None else chunk, step_tokens
        )
        for window, chunk in zip(group_windows, chunks, strict=True)
    )


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
    """What the manager keeps per request and KV cache group."""

    block_ids: list[int] = field(default_factory=list)
    #: chained hashes of the request's first full blocks (computed lazily, only ever extended;
    #: one list shared by the request's groups: the tokens are the same)
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
    :param group_windows: instead of ``sliding_window``: the window of each KV cache group
        (``None``: full attention); a null block is reserved when any group has a window.
    :param group_chunks: with ``group_windows``: the attention chunk size of each group
        (``None``: not a chunk group; a chunk group's window must be ``None``); chunk groups
        release the blocks before each request's current chunk (the module docstring), and
        a null block is reserved for them too. Default: no chunk groups.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
        group_windows: Sequence[int | None] | None = None,
        group_chunks: Sequence[int | None] | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1; got {block_size}")
        if group_windows is None:
            windows = [sliding_window]
        elif sliding_window is not None:
            raise ValueError("pass sliding_window or group_windows, not both")
        else:
            windows = list(group_windows)
            if not windows:
                raise ValueError("group_windows needs at least one group")
        for window in windows:
            if window is not None and window < 1:
                raise ValueError(f"sliding_window must be >= 1 or None; got {window}")
        chunks = [None] * len(windows) if group_chunks is None else list(group_chunks)
        if len(chunks) != len(windows):
            raise ValueError(
                f"group_chunks has {len(chunks)} groups; group_windows has {len(windows)}"
            )
        for window, chunk in zip(windows, chunks, strict=True):
            if chunk is not None and (chunk < 1 or window is not None):
                raise ValueError(
                    f"a chunk group's chunk must be >= 1 and its window None; got chunk "
                    f"{chunk}, window {window}"
                )
        #: the attention chunk size of each KV cache group (None: not a chunk group)
        self.group_chunks: list[int | None] = chunks
        #: the window of each KV cache group (None: the group's layers read every position)
        self.group_windows: list[int | None] = windows
        #: how many KV cache groups (block tables per request)
        self.num_groups = len(windows)
        #: the window every attention layer reads within, with one group; None otherwise
        self.sliding_window = single_group_window(windows)
        #: whether any group releases blocks (a window or a chunk group): a null block then
        self._releases_blocks = any(
            w is not None or c is not None for w, c in zip(windows, chunks, strict=True)
        )
        self.block_pool = BlockPool(num_blocks, reserve_null_block=self._releases_blocks)
        #: blocks of the KV cache tensors (the null block included when reserved)
        self.num_blocks = num_blocks
        #: blocks requests can hold (``num_blocks`` less the null block)
        self.num_usable_blocks = self.block_pool.num_usable_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        #: tokens looked up in the prefix cache (each call of get_computed_blocks counts)
        self.prefix_cache_queries = 0
        #: of those, tokens found
        self.prefix_cache_hits = 0
        #: request id -> its blocks in each group
        self._requests: dict[str, list[_RequestBlocks]] = {}

    # -- queries ---------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests, in ``[0, 1]`` (cached free blocks are unused)."""
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to :meth:`allocate_slots` (free cached blocks included)."""
        return self.block_pool.num_free_blocks

    def get_block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """A copy of the request's block table in ``group`` (empty if it holds no blocks);
        released entries are :data:`~chassis.core.block_pool.NULL_BLOCK_ID`."""
        states = self._requests.get(request_id)
        return list(states[group].block_ids) if states else []

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """:meth:`get_block_ids` of every group."""
        return [self.get_block_ids(request_id, g) for g in range(self.num_groups)]

    def num_null_blocks(self, request_id: str, group: int = 0) -> int:
        """How many leading entries of the request's block table in ``group`` are the null
        block (blocks released because its sliding window, or its current attention chunk,
        left them; 0 in a full-attention group)."""
        states = self._requests.get(request_id)
        return states[group].num_null_blocks if states else 0

    def group_num_null_blocks(self, request_id: str) -> list[int]:
        """:meth:`num_null_blocks` of every group; empty when no group has a window or chunks
        (every count is then 0: the scheduler sends no list per request and step)."""
        if not self._releases_blocks:
            return []
        states = self._requests.get(request_id)
        return [state.num_null_blocks for state in states] if states else [0] * self.num_groups

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds a reference to, all groups together (its block tables
        less the null entries)."""
        states = self._requests.get(request_id)
        if not states:
            return 0
        return sum(len(state.block_ids) - state.num_null_blocks for state in states)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    # -- prefix cache ----------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of full blocks of ``request.all_token_ids`` (one KV
        cache group; :meth:`get_computed_group_blocks` for several).

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
        self._require_one_group("get_computed_blocks")
        blocks, num_hit_tokens = self.get_computed_group_blocks(request)
        return blocks[0], num_hit_tokens

    def get_computed_group_blocks(self, request: Request) -> tuple[list[list[int]], int]:
        """:meth:`get_computed_blocks` over every KV cache group: ``(block ids per group,
        num_computed_tokens)``, the longest prefix of ``k`` blocks that every group serves
        (a full-attention group needs blocks ``0 .. k-1`` cached, a window group those its
        window reads at position ``k * block_size``, a chunk group those from the start of
        that position's chunk). Pass both to :meth:`allocate_group_slots`."""
        none: list[list[int]] = [[] for _ in range(self.num_groups)]
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return none, 0
        states = self._requests.get(request.request_id)
        if states is None:
            states = self._requests[request.request_id] = self._new_states()
        elif any(state.block_ids for state in states):
            raise ValueError(
                f"request {request.request_id!r} already holds KV blocks; "
                "get_computed_blocks is for requests without blocks"
            )
        num_tokens = request.num_tokens
        max_hit_blocks = (num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, states[0], max_hit_blocks)
        # Each group's longest hit within the first k blocks; k shrinks to the shortest
        # until every group serves the same k (a window group's hit at a smaller k may
        # need blocks its hit at the larger one did not, so those groups look again).
        num_hit = max_hit_blocks
        hits: list[list[int] | None] = [None] * self.num_groups
        while True:
            for group in range(self.num_groups):
                found = hits[group]
                if found is None or len(found) != num_hit:
                    hits[group] = self._group_hit(group, hashes[:num_hit])
            shortest = min(len(found) for found in hits if found is not None)
            if shortest == num_hit:
                break
            num_hit = shortest
        num_hit_tokens = num_hit * self.block_size
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return [found if found is not None else [] for found in hits], num_hit_tokens

    def _group_hit(self, group: int, hashes: list[BlockHash]) -> list[int]:
        """``group``'s longest hit over ``hashes``: a cached prefix without a window or
        chunks, else the longest hit whose next query finds every block it reads
        (:meth:`_longest_readable_hit`)."""
        size = self.block_size
        window = self.group_windows[group]
        if window is not None:
            # the next query (position k * size) reads from key k * size - W + 1 on
            return self._longest_readable_hit(
                group, hashes, lambda k: max(0, k * size - window + 1) // size
            )
        chunk = self.group_chunks[group]
        if chunk is not None:
            # ... from its chunk's start on (the module docstring, "Chunk groups")
            return self._longest_readable_hit(
                group, hashes, lambda k: k * size // chunk * chunk // size
            )
        hit_blocks: list[int] = []
        for block_hash in hashes:
            block_id = self.block_pool.get_cached_block(_group_key(group, block_hash))
            if block_id is None:
                break
            hit_blocks.append(block_id)
        return hit_blocks

    def _longest_readable_hit(
        self, group: int, hashes: list[BlockHash], first_read: Callable[[int], int]
    ) -> list[int]:
        """The longest hit of ``k`` blocks over ``hashes`` (see :meth:`get_computed_blocks`)
        whose blocks ``first_read(k) .. k - 1`` (those the next query, at position ``k *
        block_size``, reads: its window's or its chunk's) are all cached; block ids with the
        null block in place of the ``first_read(k)`` blocks before them (``[]``: none)."""
        found = [self.block_pool.get_cached_block(_group_key(group, h)) for h in hashes]
        # missing_upto[i]: the last uncached block among 0..i (-1: none)
        last_missing = -1
        missing_upto: list[int] = []
        for i, block_id in enumerate(found):
            if block_id is None:
                last_missing = i
            missing_upto.append(last_missing)
        for k in range(len(found), 0, -1):
            first = first_read(k)
            if missing_upto[k - 1] < first:  # (always when first == k: nothing to read)
                return [NULL_BLOCK_ID] * first + [b for b in found[first:k] if b is not None]
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
        """Make room for ``request`` to compute ``num_new_tokens`` more tokens (one KV cache
        group; :meth:`allocate_group_slots` for several).

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
        self._require_one_group("allocate_slots")
        hits = [list(new_computed_blocks)] if new_computed_blocks else []
        new_blocks = self.allocate_group_slots(
            request, num_new_tokens, hits, num_new_computed_tokens
        )
        return None if new_blocks is None else new_blocks[0]

    def allocate_group_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[Sequence[int]] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[list[int]] | None:
        """:meth:`allocate_slots` over every KV cache group, atomically: every group gets
        blocks for the same tokens, or (``None``) none does. ``new_computed_blocks`` is empty
        or has one list per group (:meth:`get_computed_group_blocks`); window groups release
        what their window left first. Returns the new block ids per group."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0; got {num_new_tokens}")
        states = self._requests.get(request.request_id)
        num_free_hits = 0
        has_hits = any(new_computed_blocks) or num_new_computed_tokens
        if has_hits:  # prefix-cache hits: check them
            self._check_hits(request, states, new_computed_blocks, num_new_computed_tokens)
            # Hits sitting in the free list leave it when touched, so they count against it.
            # (the null block, where a window needs none, is never free)
            num_free_hits = sum(
                1
                for blocks in new_computed_blocks
                for b in blocks
                if self.block_pool.ref_count(b) == 0
            )
        elif states is not None:
            for group in range(self.num_groups):
                first_key = self._first_key_read(group, request.num_computed_tokens)
                if first_key > 0:
                    self._release_before(request, states[group], group, first_key)
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = self.num_blocks_for(num_computed + num_new_tokens)
        num_to_take = [
            max(
                0,
                num_required
                - (len(states[g].block_ids) if states else 0)
                - (len(new_computed_blocks[g]) if has_hits else 0),
            )
            for g in range(self.num_groups)
        ]
        if sum(num_to_take) + num_free_hits > self.block_pool.num_free_blocks:
            return None

        if states is None:
            states = self._requests[request.request_id] = self._new_states()
        # every group's hits leave the free list before any group takes new blocks from it
        # (a free cached hit of one group could otherwise be handed to another)
        for group, state in enumerate(states):
            if has_hits:
                hits = new_computed_blocks[group]
                # a window or chunk hit's leading entries are the null block (in a full
                # group of a manager without them, block NULL_BLOCK_ID is an ordinary block)
                num_null = 0
                if self.group_windows[group] is not None or self.group_chunks[group] is not None:
                    while num_null < len(hits) and hits[num_null] == NULL_BLOCK_ID:
                        num_null += 1
                self.block_pool.touch(hits[num_null:])
                state.block_ids.extend(hits)
                state.num_cached_blocks = len(hits)
                state.num_null_blocks = num_null
        new_blocks: list[list[int]] = []
        for group, state in enumerate(states):
            taken = self.block_pool.get_new_blocks(num_to_take[group]) if num_to_take[group] else []
            state.block_ids.extend(taken)
            new_blocks.append(taken)
            self._cache_computed_blocks(request, state, group, num_computed)
        return new_blocks

    def _check_hits(
        self,
        request: Request,
        states: list[_RequestBlocks] | None,
        new_computed_blocks: Sequence[Sequence[int]],
        num_new_computed_tokens: int,
    ) -> None:
        """``allocate_slots``'s rules for prefix-cache hits (``ValueError`` when broken)."""
        if len(new_computed_blocks) != self.num_groups:
            raise ValueError(
                f"new_computed_blocks has {len(new_computed_blocks)} groups; the manager has "
                f"{self.num_groups}"
            )
        for blocks in new_computed_blocks:
            if num_new_computed_tokens != len(blocks) * self.block_size:
                raise ValueError(
                    f"num_new_computed_tokens ({num_new_computed_tokens}) must be "
                    f"len(new_computed_blocks) * block_size "
                    f"({len(blocks)} * {self.block_size})"
                )
        if (states is not None and any(s.block_ids for s in states)) or (
            request.num_computed_tokens
        ):
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
        states = self._requests.pop(request.request_id, None)
        if states is None:
            return
        for group, state in enumerate(states):
            self._cache_computed_blocks(request, state, group, request.num_computed_tokens)
            self.block_pool.free_blocks(reversed(state.block_ids[state.num_null_blocks :]))

    def _first_key_read(self, group: int, position: int) -> int:
        """The first position that a query of ``group``'s layers at ``position``, or at any
        later position, reads: ``position - W + 1`` with a window ``W`` (not below 0), the
        start of ``position``'s chunk in a chunk group, 0 in a full group."""
        window = self.group_windows[group]
        if window is not None:
            return max(position - window + 1, 0)
        chunk = self.group_chunks[group]
        if chunk is not None:
            return position // chunk * chunk
        return 0

    def _release_before(
        self, request: Request, state: _RequestBlocks, group: int, first_key: int
    ) -> None:
        """Release ``group``'s leading blocks wholly before position ``first_key`` (the
        first that this step of the request reads: :meth:`_first_key_read` of
        ``request.num_computed_tokens``), registered in the prefix cache first, and put the
        null block in their entries."""
        num_out = min(first_key // self.block_size, len(state.block_ids))
        if num_out <= state.num_null_blocks:
            return  # (most steps: the window has not left another block)
        self._cache_computed_blocks(request, state, group, request.num_computed_tokens)
        released = state.block_ids[state.num_null_blocks : num_out]
        state.block_ids[state.num_null_blocks : num_out] = [NULL_BLOCK_ID] * len(released)
        state.num_null_blocks = num_out
        self.block_pool.free_blocks(released)

    # -- internals -------------------------------------------------------------------------

    def _require_one_group(self, method: str) -> None:
        if self.num_groups != 1:
            raise ValueError(
                f"{method} serves one KV cache group; this manager has {self.num_groups} "
                "(use its group_ form)"
            )

    def _new_states(self) -> list[_RequestBlocks]:
        """A request's empty per-group states, sharing one list of block hashes."""
        first = _RequestBlocks()
        return [first] + [
            _RequestBlocks(block_hashes=first.block_hashes) for _ in range(self.num_groups - 1)
        ]

    def _block_hashes(
        self, request: Request, state: _RequestBlocks, num_blocks: int
    ) -> list[BlockHash]:
        """The request's chained block hashes, extended to at least ``num_blocks`` entries."""
        hashes = state.block_hashes
        if len(hashes) < num_blocks:
            tokens = request.all_token_ids
            size = self.block_size
            features = request.mm_features
            embeds = request.prompt_embeds
            for i in range(len(hashes), num_blocks):
                parent = hashes[-1] if hashes else prefix_cache_seed(request)
                start = i * size
                # (a text request hashes its token ids alone, as before images existed)
                extra = multimodal_block_keys(features, start, start + size) if features else b""
                if embeds is not None:  # placeholder ids: the rows themselves key the block
                    extra += embeds_block_keys(embeds, start, start + size)
                hashes.append(hash_block_tokens(parent, tokens[start : start + size], extra))
        return hashes

    def _cache_computed_blocks(
        self, request: Request, state: _RequestBlocks, group: int, num_computed_tokens: int
    ) -> None:
        """Register ``group``'s full blocks whose K/V cover ``num_computed_tokens``."""
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
            self.block_pool.cache_block(state.block_ids[i], _group_key(group, hashes[i]))
        state.num_cached_blocks = num_full


def _group_key(group: int, block_hash: BlockHash) -> BlockHash:
    """The prefix-cache key of a block of ``group``: group 0's is the block hash itself (so
    one group keys as before groups existed), another group's the hash and its number."""
    return block_hash if group == 0 else block_hash + b"/g%d" % group
