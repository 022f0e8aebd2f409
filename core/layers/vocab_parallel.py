"""The vocabulary split over a tensor-parallel group: embedding and LM head rows.

With ``N`` ranks, rank ``r`` holds rows ``[r * S, (r + 1) * S)`` of the embedding (and of an
untied LM head), ``S = ceil(vocab / N)`` rounded up to a multiple of 64 (the row blocks the
CPU's matmul kernel takes); the last rank's rows past the vocabulary are zero padding. A token's embedding comes from the rank that holds its row (the others add zeros,
and an all-reduce sums them); the logits of each rank's rows are gathered into the whole
vocabulary. Without a group these are the plain modules' results.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from chassis.core import parallel_state

__all__ = ["VocabParallelEmbedding", "gather_logits", "vocab_shard"]


#: per-rank vocabulary rows are a multiple of this (with more than one rank)
ROW_MULTIPLE = 64


def vocab_shard(vocab_size: int) -> tuple[int, int]:
    """This rank's ``(first row, number of rows)`` of a ``vocab_size`` vocabulary (rows past
    the vocabulary are padding); ``(0, vocab_size)`` without a group."""
    size = parallel_state.tp_size()
    if size == 1:
        return 0, vocab_size
    per_rank = -(-vocab_size // size)
    per_rank = -(-per_rank // ROW_MULTIPLE) * ROW_MULTIPLE
    return parallel_state.tp_rank() * per_rank, per_rank


class VocabParallelEmbedding(nn.Embedding):
    """An ``nn.Embedding`` of this rank's vocabulary rows (:func:`vocab_shard`); ``forward``
    takes ids of the whole vocabulary and returns the whole embedding on every rank."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        self.vocab_start, rows = vocab_shard(vocab_size)
        super().__init__(rows, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if parallel_state.tp_size() == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        held = (local >= 0) & (local < self.num_embeddings)
        embedded = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return parallel_state.all_reduce(embedded.masked_fill_(~held.unsqueeze(-1), 0.0))


def gather_logits(local_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[n, vocab_size]`` from every rank's ``[n, rows]`` logits of its vocabulary rows."""
    return parallel_state.all_gather(local_logits)[..., :vocab_size]
