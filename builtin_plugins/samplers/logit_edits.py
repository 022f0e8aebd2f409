"""Per-row edits of single logits: ``logit_bias``, ``min_tokens`` and bad-word blocking,
``allowed_token_ids``."""

from __future__ import annotations

import torch

from chassis.core.sampling_metadata import host_to_device


def apply_logit_bias(logits: torch.Tensor, biases: list[dict[int, float] | None]) -> torch.Tensor:
    """Add ``biases[row][token]`` to ``logits[row, token]`` in place; returns ``logits``.

    All rows go in one indexed add (one host-to-device copy of the index and values).
    """
    rows: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for row, bias in enumerate(biases):
        if bias:
            rows.extend([row] * len(bias))
            ids.extend(bias.keys())
            values.extend(bias.values())
    if rows:
        device = logits.device
        logits.index_put_(
            (host_to_device(rows, torch.int64, device), host_to_device(ids, torch.int64, device)),
            host_to_device(values, logits.dtype, device),
            accumulate=True,
        )
    return logits


def apply_min_tokens(logits: torch.Tensor, blocked: list[set[int] | None]) -> torch.Tensor:
    """Set ``logits[row, token]`` to ``-inf`` for every ``token in blocked[row]``, in place.

    Used for rows that have not yet produced ``min_tokens`` tokens (their EOS and stop ids
    must not be sampled) and for the tokens that would complete a bad word. Returns
    ``logits``.
    """
    rows: list[int] = []
    ids: list[int] = []
    for row, tokens in enumerate(blocked):
        if tokens:
            rows.extend([row] * len(tokens))
            ids.extend(tokens)
    if rows:
        device = logits.device
        index = (
            host_to_device(rows, torch.int64, device),
            host_to_device(ids, torch.int64, device),
        )
        # A fill on the device, not a copy of a host scalar (which could synchronize).
        logits.index_put_(index, torch.full((), float("-inf"), device=device))
    return logits


def apply_allowed_token_ids(logits: torch.Tensor, allowed: list[list[int] | None]) -> torch.Tensor:
    """Set every logit of row ``r`` outside ``allowed[r]`` to ``-inf``, in place (rows with
    ``None`` are left alone). Returns ``logits``."""
    rows = [r for r, ids in enumerate(allowed) if ids is not None]
    if not rows:
        return logits
    device = logits.device
    keep = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool, device=device)
    for i, row in enumerate(rows):
        keep[i, host_to_device(allowed[row], torch.int64, device)] = True
    index = host_to_device(rows, torch.int64, device)
    logits[index] = logits[index].masked_fill(~keep, float("-inf"))
    return logits
