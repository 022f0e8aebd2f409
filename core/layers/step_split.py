"""A step's requests split by kind for the recurrent mixers (Mamba-1, Mamba2, Gated DeltaNet):
the requests with one token in the step (decodes), which advance their states in one batched
step, and those with more (prefill chunks), which run together through the packed conv and
a chunked scan. The index tensors are built on the host, in numpy, once per step and cached
for the step's other layers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch


def index_tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """``a`` as an int64 index tensor on ``device``."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)


@dataclass(frozen=True)
class StepSplit:
    """A step's requests by kind: those with one token (decodes; ``single_rows`` their
    requests, ``single_tokens`` their token rows) and those with more (``many``, their
    requests' indices; ``many_rows``, ``many_tokens`` and ``many_lengths`` for the batched
    prefill)."""

    single_rows: torch.Tensor
    single_tokens: torch.Tensor
    many: tuple[int, ...]
    many_rows: torch.Tensor
    many_tokens: torch.Tensor
    many_lengths: tuple[int, ...]


@functools.lru_cache(maxsize=8)
def step_split(bounds: tuple[int, ...], device: torch.device) -> StepSplit:
    """:class:`StepSplit` of a step whose request ``i`` owns token rows ``bounds[i]:bounds[i
    + 1]``. Cached: every mixer layer of a step asks for the same one."""
    starts = np.asarray(bounds[:-1], dtype=np.int64)
    lengths = np.diff(np.asarray(bounds, dtype=np.int64))
    singles = np.flatnonzero(lengths == 1)
    many = np.flatnonzero(lengths > 1)
    many_tokens = np.concatenate(
        [np.arange(starts[i], starts[i] + lengths[i]) for i in many] or [np.zeros(0, np.int64)]
    )
    return StepSplit(
        single_rows=index_tensor(singles, device),
        single_tokens=index_tensor(starts[singles], device),
        many=tuple(int(i) for i in many),
        many_rows=index_tensor(many, device),
        many_tokens=index_tensor(many_tokens, device),
        many_lengths=tuple(int(n) for n in lengths[many]),
    )
