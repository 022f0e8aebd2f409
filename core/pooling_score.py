"""Bi-encoder scoring: the cosine similarity of two texts' embeddings (vLLM's score for
embedding models), shared by ``LLM.score`` and the server's ``/score`` and ``/rerank``.

A score request pairs the texts of two sides 1:1, 1:N (one first text against every second
text) or N:N (position by position), as vLLM does. Each distinct text is embedded once;
:func:`score_outputs` then takes the cosine of each pair's vectors in float32.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from chassis.core.pooling_outputs import EmbeddingRequestOutput

T = TypeVar("T")


@dataclass
class ScoringOutput:
    """One pair's score (vLLM's ``ScoringOutput``): the cosine similarity, in [-1, 1]."""

    score: float


@dataclass
class ScoringRequestOutput:
    """The result of scoring one pair, as vLLM's ``ScoringRequestOutput``.

    ``request_id`` joins the two embedding requests' ids with ``_``; ``prompt_token_ids`` is
    the first text's tokens, the tokenizer's pad token when it has one, then the second's
    (what vLLM reports, and what the server's usage counts).
    """

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


def score_pairs(num_first: int, num_second: int) -> list[tuple[int, int]]:
    """The ``(first index, second index)`` of every pair to score, in the order of the
    answer: 1:1, 1:N (the one first text against each second text) or N:N (position by
    position). Anything else (N:M, N:1, an empty side) raises ``ValueError``."""
    if num_first == 0:
        raise ValueError("At least one text element must be given (text_1 is empty)")
    if num_second == 0:
        raise ValueError("At least one text_pair element must be given (text_2 is empty)")
    if num_first == 1:
        return [(0, j) for j in range(num_second)]
    if num_first != num_second:
        raise ValueError(
            "Input lengths must be either 1:1, 1:N or N:N; got "
            f"{num_first} first texts and {num_second} second texts"
        )
    return [(i, i) for i in range(num_first)]


def distinct(items: Sequence[T], key: Sequence[Hashable]) -> tuple[list[T], list[int]]:
    """``items`` without repeats (by ``key``, one per item, first occurrence kept) and, for
    each item, its position in that list: each distinct text is embedded only once."""
    seen: dict[Hashable, int] = {}
    unique: list[T] = []
    where: list[int] = []
    for item, k in zip(items, key, strict=True):
        if k not in seen:
            seen[k] = len(unique)
            unique.append(item)
        where.append(seen[k])
    return unique, where


def score_outputs(
    pairs: Sequence[tuple[EmbeddingRequestOutput, EmbeddingRequestOutput]],
    pad_token_id: int | None = None,
) -> list[ScoringRequestOutput]:
    """Each pair's cosine similarity (float32, as ``torch.nn.functional.cosine_similarity``:
    norms below 1e-8 are taken as 1e-8), in the order of ``pairs``. ``pad_token_id`` (the
    tokenizer's, when it has one) goes between each pair's two texts' tokens in
    ``prompt_token_ids``, as vLLM joins them, so token counts match vLLM's."""
    if not pairs:
        return []
    first = torch.tensor([a.outputs.embedding for a, _ in pairs], dtype=torch.float32)
    second = torch.tensor([b.outputs.embedding for _, b in pairs], dtype=torch.float32)
    scores = torch.nn.functional.cosine_similarity(first, second, dim=-1).tolist()
    padding = [] if pad_token_id is None else [pad_token_id]
    return [
        ScoringRequestOutput(
            request_id=f"{a.request_id}_{b.request_id}",
            outputs=ScoringOutput(score=score),
            prompt_token_ids=list(a.prompt_token_ids) + padding + list(b.prompt_token_ids),
        )
        for (a, b), score in zip(pairs, scores, strict=True)
    ]
