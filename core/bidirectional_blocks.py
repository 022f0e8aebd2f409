"""Prefill chunks around blocks of tokens that attend to one another both ways.

Gemma 3's image tokens attend to every token of their image, later ones included
(``CausalLM.bidirectional_image_blocks``). A prefill chunk that ended strictly inside such a
block would compute its first tokens without the block's later keys, which do not exist yet:
the result would differ from the model's. So a scheduler plans every chunk with
:func:`chunk_outside_blocks`, over the request's ``bidirectional_blocks`` (the engine core sets
them from the image placeholders; :mod:`chassis.core.multimodal_admission` refuses a block
longer than ``--max-num-batched-tokens``, which could never be scheduled).

A chunk that starts inside a block (a prefix-cache hit ending there: that K/V was computed with
the whole block present, as every chunk is) must take the rest of the block at once.
"""

from __future__ import annotations

from collections.abc import Sequence


def chunk_outside_blocks(start: int, num_tokens: int, blocks: Sequence[tuple[int, int]]) -> int:
    """How many of ``num_tokens`` tokens from sequence position ``start`` a step may compute
    so that it ends at no position strictly inside a block ``(begin, end)`` of ``blocks``
    (prompt order, not overlapping): ``num_tokens`` itself when its end is outside every
    block; else the tokens up to the start of the block its end falls in, or 0 when the chunk
    starts at or inside that block (it must wait for a step with room for the block's rest)."""
    stop = start + num_tokens
    for begin, end in blocks:
        if begin < stop < end:
            return max(begin - start, 0)
        if begin >= stop:
            break
    return num_tokens
