"""The memory profile's decode step for models with per-request recurrent state.

The start-up profile (``ModelRunner.profile_run``) runs the whole token budget as prefills
of at most ``max_model_len`` tokens, without state slots (each request starts from zeros):
a handful of requests. A decode step of ``max_num_seqs`` requests reads and writes that many
slots of the state pool, and the state mixers' temporaries grow with the number of requests,
not of tokens: each layer gathers the step's states (``pool[slots]``, widened to float32),
computes new ones beside them and writes them back (Qwen3-Next-80B: 32 value heads of a
128 x 128 float32 delta-rule state, 2 MiB per request per copy). Measured on one layer of
real shapes with 256 sequences and a 2,048-token budget, the decode step's peak is about twice
the prefill's (docs/architecture.md, "The profile's decode step"), so the profile also runs
one dummy decode step over as many free slots as a step can hold, and zeroes them after.

Only free slots are used (at start-up, all of them), so requests' states are never touched;
a slot handed out is zeroed again anyway (``RequestStatePool.allocate``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from chassis.core.request_state_cache import RequestStatePool


def free_state_slots(pool: RequestStatePool, max_slots: int) -> list[int]:
    """Up to ``max_slots`` slots of ``pool`` that no request holds, lowest first."""
    held = set(pool.slot_of.values())
    return [slot for slot in range(pool.num_slots) if slot not in held][: max(max_slots, 0)]


@contextmanager
def borrowed_state_slots(
    pool: RequestStatePool, max_slots: int, device: torch.device | str
) -> Iterator[torch.Tensor]:
    """Lend up to ``max_slots`` free slots of ``pool`` (an int64 tensor on ``device``; empty
    when none is free or the pool is released) to a dummy step, and zero them in every
    state tensor afterwards, whatever the step did."""
    slots = [] if pool.released else free_state_slots(pool, max_slots)
    index = torch.tensor(slots, dtype=torch.int64, device=device)
    try:
        yield index
    finally:
        if slots:
            for tensor in pool.tensors:
                tensor.index_fill_(0, index, 0)
