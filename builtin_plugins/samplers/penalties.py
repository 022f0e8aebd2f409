"""Repetition, presence and frequency penalties (vLLM/HF semantics), vectorized over rows."""

from __future__ import annotations

import itertools

import torch

from chassis.core.sampling_metadata import host_to_device


def token_counts(histories: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[len(histories), vocab_size]`` float32: how often each token occurs in each row.

    One host-to-device copy of all ids; the counting is a single ``index_add_`` on the
    device (no per-row work there). Ids must lie in ``[0, vocab_size)``.
    """
    num_rows = len(histories)
    counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
    lengths = [len(h) for h in histories]
    if sum(lengths) == 0:
        return counts.view(num_rows, vocab_size)
    # Flat index row * vocab + id, computed on the host where building it is C-speed.
    ids = torch.tensor(list(itertools.chain.from_iterable(histories)), dtype=torch.int64)
    row_of = torch.repeat_interleave(torch.arange(num_rows), torch.tensor(lengths))
    flat = host_to_device(row_of * vocab_size + ids, torch.int64, device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
    return counts.view(num_rows, vocab_size)


def apply_penalties(
    logits: torch.Tensor,
    prompt_counts: torch.Tensor | None,
    output_counts: torch.Tensor,
    repetition_penalty: torch.Tensor | None,
    presence_penalty: torch.Tensor | None,
    frequency_penalty: torch.Tensor | None,
) -> torch.Tensor:
    """Penalize tokens already seen, in place; returns ``logits``.

    - repetition ``r`` (tokens in the prompt or the output): ``x / r`` if ``x > 0`` else
      ``x * r`` (so ``r > 1`` always makes a seen token less likely);
    - presence ``p`` (tokens in the output): ``x - p``;
    - frequency ``f`` (tokens in the output): ``x - f * count``.

    :param logits: ``[num_rows, vocab]`` float32
    :param prompt_counts: ``[num_rows, vocab]`` occurrences in the prompt (None: empty)
    :param output_counts: ``[num_rows, vocab]`` occurrences in the output so far
    :param repetition_penalty: ``[num_rows]``, 1.0 = off; None = off for every row
    :param presence_penalty: ``[num_rows]``, 0.0 = off; None = off for every row
    :param frequency_penalty: ``[num_rows]``, 0.0 = off; None = off for every row
    """
    in_output = output_counts > 0
    if repetition_penalty is not None:
        seen = in_output if prompt_counts is None else in_output | (prompt_counts > 0)
        penalty = torch.where(seen, repetition_penalty.unsqueeze(1), 1.0)
        logits.copy_(torch.where(logits > 0, logits / penalty, logits * penalty))
    if frequency_penalty is not None:
        logits.sub_(frequency_penalty.unsqueeze(1) * output_counts)
    if presence_penalty is not None:
        logits.sub_(presence_penalty.unsqueeze(1) * in_output)
    return logits
