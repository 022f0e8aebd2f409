"""Rejection sampling of probabilistic drafts on a real GPU at a real vocabulary (run by
tests/gpu/run_gpu_checks.sh): the vectorized step (core/rejection_sampling.py) gives the
one-draft-at-a-time reference's tokens on the same random numbers, and it never waits for
the device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ helpers

from fixtures_speculative import assert_requests_equal_the_reference

from chassis.core.rejection_sampling import exponential_noise, rejection_sample

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]
VOCAB = 151_936  # Qwen3's
NUM_REQUESTS = 48


def _batch(generator: torch.Generator):
    """Requests with 0 to 4 drafts drawn from q (q close to p for half of them), stacked as
    the runner stacks verify rows."""
    p_rows, q_rows, ids, bonus, spans = [], [], [], [], []
    for r in range(NUM_REQUESTS):
        d = int(torch.randint(0, 5, (1,), generator=generator, device="cuda"))
        p = torch.randn(d + 1, VOCAB, generator=generator, device="cuda").mul(3).softmax(-1)
        q = torch.randn(d, VOCAB, generator=generator, device="cuda").mul(3).softmax(-1)
        if r % 2 and d:
            q = 0.8 * p[:d] + 0.2 * q
        drafts = torch.multinomial(q, 1, generator=generator).squeeze(1).tolist() if d else []
        spans.append((len(ids), d, drafts))
        p_rows.append(p)
        q_rows.append(torch.cat([q, torch.zeros(1, VOCAB, device="cuda")]))
        ids += [*drafts, 0]
        bonus += [False] * d + [True]
    return (
        torch.cat(p_rows),
        torch.cat(q_rows),
        torch.tensor(ids, device="cuda"),
        torch.tensor(bonus, device="cuda"),
        spans,
    )


def test_the_vectorized_step_equals_the_reference_on_the_gpu() -> None:
    generator = torch.Generator(device="cuda").manual_seed(3)
    for _ in range(5):
        target, draft, ids, bonus, spans = _batch(generator)
        uniforms = torch.rand(ids.shape[0], generator=generator, device="cuda")
        noise = exponential_noise((ids.shape[0], VOCAB), "cuda")
        tokens = rejection_sample(target, draft, ids, bonus, uniforms, noise).tolist()
        assert_requests_equal_the_reference(tokens, target, draft, uniforms, noise, spans)


def test_the_vectorized_step_does_not_wait_for_the_device() -> None:
    generator = torch.Generator(device="cuda").manual_seed(4)
    target, draft, ids, bonus, _ = _batch(generator)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = rejection_sample(target, draft, ids, bonus)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.shape == ids.shape and tokens.device.type == "cuda"
