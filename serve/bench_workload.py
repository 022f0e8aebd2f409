"""Benchmark workloads: random-token prompts with fixed or uniform lengths, reproducible."""

from __future__ import annotations

import random
from dataclasses import dataclass


def parse_length(spec: str) -> tuple[int, int]:
    """``"128"`` -> (128, 128); ``"32:256"`` -> uniform in [32, 256]."""
    lo, _, hi = spec.partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"a length is N or MIN:MAX, got {spec!r}") from None
    if low < 1 or high < low:
        raise ValueError(f"a length range needs 1 <= MIN <= MAX, got {spec!r}")
    return low, high


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def random_workload(
    num_requests: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    excluded_ids: set[int] | frozenset[int] = frozenset(),
    seed: int = 0,
) -> list[BenchRequest]:
    """``num_requests`` prompts of random token ids (never ``excluded_ids``, e.g. specials)."""
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in excluded_ids]
    workload = []
    for _ in range(num_requests):
        n_in = rng.randint(*input_len)
        n_out = rng.randint(*output_len)
        workload.append(BenchRequest([rng.choice(allowed) for _ in range(n_in)], n_out))
    return workload
