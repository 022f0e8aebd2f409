"""Drafts for seeded random requests: their stream stays one draw per output token.

A request with its own ``seed`` samples with its own generator, from which the sampler draws
exactly one ``[vocab_size]`` noise vector per sampling row, rows in order
(:class:`~chassis.core.sampling_metadata.SamplingRow`). Plain decoding thus spends vector
``n`` of the stream on output token ``n``. A verify step of a request with ``n`` tokens
output and ``d`` drafts has ``d + 1`` rows, and row ``m`` draws vector ``n + m``: exactly the
vector plain decoding spends on token ``n + m``, given the same tokens before it (the
accepted drafts *are* the tokens sampled at their rows). Its drafts are one-hot (n-gram
drafts, or the draft model's argmax), verified by exact match, so the step's ``a + 1``
tokens are plain decoding's own. Only the generator is ahead: it drew ``d + 1`` vectors for
``a + 1`` tokens. :class:`StreamRewind` puts it back at vector ``n + a + 1``.

So a seeded request gets the very tokens it gets without speculative decoding (within
float32 rounding of the logits, as across batches), whatever its drafts, the other requests
of its steps, the token budget or preemptions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from chassis.core.sampling_metadata import SAMPLING_EPS

if TYPE_CHECKING:
    from chassis.core.input_batch import RequestState


def skip_draws(generator: torch.Generator, num_draws: int, vocab_size: int) -> None:
    """Advance ``generator`` past ``num_draws`` sampling rows: one float32 ``[vocab_size]``
    uniform vector each, as the sampler draws them (on the generator's device)."""
    if num_draws <= 0:
        return
    noise = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
    for _ in range(num_draws):
        noise.uniform_(generator=generator)


@dataclass
class StreamRewind:
    """A seeded request's generator as it was before a verify step of ``num_drafts``
    drafts."""

    generator: torch.Generator
    #: ``generator.get_state()`` before the step's sampler ran
    state: torch.Tensor
    num_drafts: int
    vocab_size: int

    def apply(self, num_tokens: int) -> None:
        """Leave the generator past exactly ``num_tokens`` draws from the saved state: the
        tokens the step output (accepted drafts and the model's own next one)."""
        if num_tokens == self.num_drafts + 1:
            return  # every draft kept: one draw per row was one draw per token
        self.generator.set_state(self.state)
        skip_draws(self.generator, num_tokens, self.vocab_size)


def stream_rewinds(
    states: Sequence[RequestState], drafts: dict[str, list[int]], vocab_size: int
) -> dict[str, StreamRewind]:
    """Request id -> its :class:`StreamRewind`, for the step's seeded random requests with
    drafts (``states``: the step's sampling rows' requests; ``drafts``: the step's drafts).
    Call before the sampler draws; apply once the step's accepted tokens are known."""
    rewinds: dict[str, StreamRewind] = {}
    for state in states:
        generator = state.generator
        request_drafts = drafts.get(state.request_id)
        if (
            generator is None
            or not request_drafts
            or state.sampling_params.temperature < SAMPLING_EPS
            or state.request_id in rewinds
        ):
            continue
        rewinds[state.request_id] = StreamRewind(
            generator, generator.get_state(), len(request_drafts), vocab_size
        )
    return rewinds
