"""The exponential race (core/token_draw.py): its noise is float32 whatever the
probabilities' dtype, which seeded requests' generator bookkeeping
(core/seeded_drafts.py) relies on."""

from __future__ import annotations

import pytest
import torch

from chassis.core.seeded_drafts import skip_draws
from chassis.core.token_draw import exponential_noise, exponential_race

ROWS, VOCAB = 4, 50


def _generators(seed: int) -> dict[int, torch.Generator]:
    return {row: torch.Generator().manual_seed(seed * 100 + row) for row in range(ROWS)}


def test_the_noise_is_float32() -> None:
    assert exponential_noise((ROWS, VOCAB), "cpu").dtype == torch.float32
    assert exponential_noise((ROWS, VOCAB), "cpu", _generators(0)).dtype == torch.float32


@pytest.mark.parametrize("consume", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_probs_draw_the_token_of_their_float32_copy(
    dtype: torch.dtype, consume: bool
) -> None:
    """Same seeded generators, same tokens as the float32 copy; each generator advanced by
    one float32 ``[vocab]`` draw, as ``skip_draws`` replays it."""
    for seed in range(20):
        logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(seed))
        probs = logits.softmax(dim=-1).to(dtype)
        copy = probs.float()
        generators, copy_generators = _generators(seed), _generators(seed)
        drawn = exponential_race(probs.clone(), generators, consume=consume)
        expected = exponential_race(copy.clone(), copy_generators, consume=consume)
        assert torch.equal(drawn, expected)
        for row, generator in generators.items():
            replayed = torch.Generator().manual_seed(seed * 100 + row)
            skip_draws(replayed, 1, VOCAB)
            assert torch.equal(generator.get_state(), replayed.get_state())
